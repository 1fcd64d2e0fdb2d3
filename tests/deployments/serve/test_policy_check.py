"""`mpic.deployments.serve.policy_check` (fast, no Ray): a chat's policy parsed and checked once at
the Resolver (the linker's own `Policy` back; 400 on `mpic.policy` for unknown names, huge numbers
and per-layer ratios the model cannot take), and the model's layer count the app builder binds
into the Resolver, read from config.json alone (compared with `ModelSpec`'s full read)."""

from __future__ import annotations

import pytest

from mpic.deployments.serve.policy_check import MAX_POLICY_NUMBER, check_policy, model_layers
from mpic.errors import InvalidRequestError
from mpic.linker.policies import get_policy


@pytest.mark.parametrize(
    "name", ["full", "mpic-2", "full-reuse", "auto", "auto-0.3", "vlcache-0.5"]
)
def test_good_names_give_the_linkers_policy(name: str) -> None:
    assert check_policy(name, None).name == get_policy(name).name
    assert check_policy(name, 2).name == get_policy(name).name


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("no-such-policy", "unknown policy"),
        ("mpic-" + "9" * 5000, "5000-digit number is out of range"),
        ("mpic-99999999999", "99999999999 is out of range"),
        (f"mpic-{MAX_POLICY_NUMBER + 1}", "out of range"),
        ("cacheblend-abc", "bad policy"),
    ],
)
def test_bad_names_are_400_on_mpic_policy(name: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        check_policy(name, None)
    assert err.value.status == 400 and err.value.param == "mpic.policy"
    assert words in str(err.value) and len(str(err.value)) < 300


def test_scout_scoring_layers_are_checked_against_the_layer_count() -> None:
    assert check_policy("scout-0.2:l1-3", None).layers == [1, 2, 3]  # depth unknown
    assert check_policy("scout-0.2:l1-3", 4).scoring_layers(4) == [1, 2, 3]
    with pytest.raises(InvalidRequestError, match="past the model's 3 layers") as err:
        check_policy("scout-0.2:l1-3", 3)
    assert err.value.param == "mpic.policy" and err.value.status == 400


def test_per_layer_ratios_are_checked_against_the_layer_count() -> None:
    assert check_policy("vlcache-0.5:0.4:0.3", None).name  # depth unknown: not checked
    assert check_policy("vlcache-0.5:0.4", 2).layer_ratios(2) == [0.5, 0.4]
    with pytest.raises(InvalidRequestError) as err:
        check_policy("vlcache-0.5:0.4:0.3", 2)
    assert err.value.param == "mpic.policy" and "2-layer" in str(err.value)


def _engine(kind: str, model: str):
    from mpic.deployments.config import ServeAppConfig

    return ServeAppConfig.model_validate({"engine": {"kind": kind, "model": model}}).engine


def test_model_layers_from_config_json(tiny_llava_dir, tiny_qwen2vl_dir, tmp_path) -> None:
    from mpic.model_spec import ModelSpec

    for folder in (tiny_llava_dir, tiny_qwen2vl_dir):
        want = ModelSpec.from_pretrained(folder).num_layers
        assert model_layers(_engine("reference", str(folder))) == want
        assert model_layers(_engine("vllm", str(folder))) == want
    assert model_layers(_engine("fake", str(tiny_llava_dir))) is None  # no model behind it
    assert model_layers(_engine("reference", str(tmp_path / "missing"))) is None


def test_model_layers_reads_only_config_json_from_s3(tiny_llava_dir, s3_server) -> None:
    from mpic.storage.s3_store import S3ObjectStore

    cfg = s3_server.config(prefix="models/llava")
    S3ObjectStore(cfg).put("config.json", (tiny_llava_dir / "config.json").read_bytes())
    url = (
        f"s3://{cfg.bucket}/models/llava?endpoint={cfg.endpoint}&secure=false"
        "&access_key=testing&secret_key=testing&region=us-east-1"
    )
    assert model_layers(_engine("vllm", url)) == 2  # no weights under the prefix: none read
