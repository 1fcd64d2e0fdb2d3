"""A model folder with another chat template (vLLM's `--chat-template`; any process that loads a
model: Encoder and LLM-worker Serve replicas, vLLM's engine processes).

Every component of MPIC reads the chat template from the model folder (the serving engines'
processors, the canonical context entries are cached in, vLLM's own tokenizer), so the override
is applied once, to the folder: `with_chat_template(model, template)` returns an overlay folder
beside the model cache whose files link to the model's, except the template files, which carry
`template` (`chat_template.jinja`, `chat_template.json` and the `chat_template` of
`tokenizer_config.json`). The overlay is named by the hash of (model folder, template), so
replicas on one node share it and a changed template gets a new folder (and new entry ids: the
canonical context changes with the template).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def read_template(value: str) -> str:
    """The template text of `value`: the contents of that file when it names one (as vLLM's
    flag takes a path), else `value` itself (an inline Jinja template)."""
    path = Path(value).expanduser()
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{" not in value:
        raise FileNotFoundError(f"chat template {value!r}: no such file (and not a template)")
    return value


def with_chat_template(model_dir: str, template: str, root: Path | None = None) -> str:
    """A folder that is `model_dir` (a local folder) with chat template `template` (text or a
    file path, `read_template`); written once under `root` (default: the model cache)."""
    from mpic.config import MPICHome

    text = read_template(template)
    src = Path(model_dir).resolve()
    digest = hashlib.sha256(f"{src}\0{text}".encode()).hexdigest()[:16]
    out = (root or MPICHome().models_dir) / "chat-template" / f"{src.name}-{digest}"
    if (out / "chat_template.jinja").is_file():
        return str(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name not in TEMPLATE_FILES and not (tmp / item.name).exists():
            (tmp / item.name).symlink_to(item)
    tok_cfg = src / "tokenizer_config.json"
    if tok_cfg.is_file():
        data = json.loads(tok_cfg.read_text(encoding="utf-8"))
        data["chat_template"] = text
        (tmp / "tokenizer_config.json").write_text(json.dumps(data, indent=1), encoding="utf-8")
    (tmp / "chat_template.json").write_text(json.dumps({"chat_template": text}), "utf-8")
    (tmp / "chat_template.jinja").write_text(text, encoding="utf-8")  # written last: complete
    try:
        tmp.rename(out)
    except OSError:  # another replica won the race: same contents
        pass
    return str(out)
