"""Every module, function, class, attribute and CLI flag the docs name in backticks exists
(docs/*.md, README.md, CONTRIBUTING.md; the rules: `tests/architecture/doc_names.py`)."""

from __future__ import annotations

import pytest

from tests.architecture import doc_names, doc_spans
from tests.architecture.code_names import code_index


def test_every_name_the_docs_give_in_backticks_exists() -> None:
    found = doc_names.problems()
    assert not found, "stale names in the docs (fix the doc, or see doc_names.py):\n" + "\n".join(
        found
    )


@pytest.mark.parametrize(
    "token",
    [
        "linker/recipe.py",
        "linker/policies/*.py",
        "engine/hf/",
        "docs/bench_storage.png",
        "storage/factory.py:make_object_store",
        "engine/tiny/configs.REAL_PREPROCESSOR_CONFIGS",
        "tests/linker/test_prefix.py",
        "request_flow.py",
        "policies/base.py",
        "mpic.linker.recipe",
        "mpic.linker.policies.get_policy",
        "mpic.deployments.engines.engine.ServeEngine.generate",
        "mpic.deployments.app:app_builder",
        "mpic.recompute_budget",
        "LinkPlan.recompute_depth",
        "ScoutPolicy.scale",
        "VllmEngineConfig.link_prefix",
        "ClipEmbedder.embed_images/embed_texts/embed_passages",
        "ReferenceRunner.press_entry(entry, press, budget)",
        "DEFAULT_BUDGET",
        "link_job.batchable",
        "worker._shift_last_query",
        "engine.kind",
        "get_policy(name)",
        "plan_prompt",
        "ray_mpic_prompt_tokens_total",
        "--images",
        "--link-prefix/--no-link-prefix",
        "mpic bench offline --images 4,8 --repeats 3",
        "mpic-admin sweep [--store URL | --server URL --api-key KEY] [--grace-s S]",
        "mpic-admin library refresh/list/show/rollback/search",
        "AsyncLLM",
        "torch.compile",
        "kubectl apply -k k8s/",
        "mpic-32",
        "full",
    ],
)
def test_live_names_and_prose_pass(token: str) -> None:
    assert doc_names.check_token(token) is None


@pytest.mark.parametrize(
    "token",
    [
        "linker/gone.py",
        "docs/gone.png",
        "linker/policies/*.rs",
        "gone_module.py",
        "linker/recipe.py:gone",
        "engine/tiny/configs.GONE",
        "tests/linker/test_prefix.py::test_gone",
        "mpic.linker.gone",
        "mpic.linker.recipe.gone",
        "mpic.deployments.reference_engine",
        "mpic.engine.protocol.Engine.gone",
        "LinkPlan.gone",
        "VllmFrontEnd.prepare/gone",
        "ReferenceRunner.gone(x)",
        "GoneServeEngine",
        "GONE_DEFAULTS",
        "link_job.gone",
        "gone_function(x)",
        "plan_prompt_gone",
        "mpic_gone_total",
        "--gone",
        "mpic bench offline --gone 3",
        "mpic bench gone",
        "mpic bench offline|gone",
        "mpic-admin --gone",
    ],
)
def test_stale_names_are_caught(token: str) -> None:
    assert doc_names.check_token(token) is not None


def test_fenced_blocks_and_spans_across_lines_are_read(tmp_path) -> None:  # noqa: ANN001
    page = tmp_path / "page.md"
    page.write_text(
        "Text `mpic.linker.recipe` and `mpic bench\noffline --gone-inline` across lines.\n\n"
        "1. A list item:\n\n"
        "   ```bash\n"
        "   .venv/bin/mpic bench offline --images 1,2 \\\n"
        "       --gone 3   # --write\n"
        "   mpic model make-tiny --family llava && mpic bench gone\n"
        "   vllm serve --gone-too\n"
        "   ```\n\n"
        "```python\n"
        "from mpic.linker.recipe import plan_prompt, gone_function\n"
        "```\n"
    )
    found = doc_names.problems([page])
    assert [line.split(": ", 1)[0].rsplit(":", 1)[1] for line in found] == ["1", "7", "9", "14"]
    assert "--gone-inline" in found[0] and "--gone" in found[1] and "bench gone" in found[2]
    assert "gone_function" in found[3]


def test_foreign_and_allowed_entries_are_still_needed() -> None:
    """Each allow-list entry is still named by a doc and not already a project name."""
    named = {span.text for path in doc_names.DOCS for span in doc_spans.spans(path)}
    text = " ".join(named)
    words = code_index().words
    for names in doc_names.FOREIGN.values():
        for name in names:
            assert name in text, f"FOREIGN {name!r}: no doc names it any more"
            assert name not in words, f"FOREIGN {name!r}: the project's code spells it"
    for token in doc_names.ALLOWED:
        assert token in named, f"ALLOWED {token!r}: no doc names it any more"
