"""The Serve seam: the messages between deployments, the HTTP schemas and the ingress (with its
catalog-only file library) import without torch."""

from __future__ import annotations

import subprocess
import sys


def test_messages_and_http_schemas_are_torch_free() -> None:
    code = (
        "import sys\n"
        "import mpic.deployments.messages, mpic.deployments.chat_request\n"
        "import mpic.deployments.file_schemas, mpic.deployments.http.schemas.answers\n"
        "import mpic.deployments.http.auth\n"
        "import mpic.deployments.http.http_errors, mpic.prompt_parts, mpic.retriever.spec\n"
        "import mpic.deployments.http.ingress, mpic.deployments.serve.files\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_prompts_parsed_policy_crosses_the_ingress_unread() -> None:
    """The Resolver's parsed policy travels in the prompt (Resolver -> Ingress -> LLM worker,
    each hop a pickle): the Ingress unpickles and pickles it again without importing torch, and
    the worker gets the same policy back without parsing its name."""
    import pickle

    from mpic.deployments.messages import LinkedPrompt, LinkedTurn, Segment
    from mpic.linker.policies import get_policy

    prompt = LinkedPrompt([LinkedTurn("user", [Segment("text", text="hi")])], "auto", 4)
    prompt.serve_by("auto", get_policy("auto"))
    code = (
        "import pickle, sys\n"
        "prompt = pickle.loads(sys.stdin.buffer.read())\n"
        "assert prompt.policy == 'auto', prompt.policy\n"
        "assert 'torch' not in sys.modules\n"
        "sys.stdout.buffer.write(pickle.dumps(prompt))\n"
    )
    relayed = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(prompt), capture_output=True, check=True
    ).stdout
    worker = pickle.loads(relayed)
    assert worker.policy == "auto" and worker.parsed_policy is not None
    policy = worker.parsed_policy.get()
    assert policy.name == get_policy("auto").name and vars(policy) == vars(get_policy("auto"))
    assert worker.parsed_policy.get() is policy  # unpickled once
