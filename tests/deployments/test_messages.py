"""The Serve seam: the messages between deployments, the HTTP schemas and the ingress (with its
catalog-only file library) import without torch."""

from __future__ import annotations

import subprocess
import sys


def test_messages_and_http_schemas_are_torch_free() -> None:
    code = (
        "import sys\n"
        "import mpic.deployments.messages, mpic.deployments.chat_request\n"
        "import mpic.deployments.file_schemas, mpic.deployments.http.answer_schemas\n"
        "import mpic.deployments.http.auth\n"
        "import mpic.deployments.http.http_errors, mpic.prompt_parts, mpic.retriever.spec\n"
        "import mpic.deployments.http.ingress, mpic.deployments.serve.files\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
