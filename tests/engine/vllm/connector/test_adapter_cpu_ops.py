"""The vLLM layer adapter's CPU shortcuts give vLLM's own modules' values: the RMSNorm through
vLLM's fused CPU kernel (`cpu_rms_norm`) and the gated MLP with its product in place
(`cpu_gated_mlp`). Runs vLLM's modules and CPU ops directly (no engine); skipped where the ops
are not built."""

import pytest
import torch
from torch import nn

from mpic.engine.vllm.connector.adapter import cpu_gated_mlp, cpu_rms_norm
from tests.engine.vllm.connector.cpu_ops import vllm_cpu_op_built

pytestmark = pytest.mark.skipif(not vllm_cpu_op_built("rms_norm"), reason="vLLM's CPU ops")


@pytest.fixture
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_cpu_rms_norm_equals_vllm_module(vllm_config, eps):
    from vllm.model_executor.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, eps=eps)
    norm.weight.data.normal_()
    x = torch.randn(37, 96) * 1e-3  # a mean square of 1e-6: the epsilon counts
    got = cpu_rms_norm(norm, x)
    want = norm(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, x)  # it normalised


def test_cpu_rms_norm_of_a_strided_input(vllm_config):
    """A column slice (not contiguous) is normalised as its contiguous copy."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm = RMSNorm(32, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    wide = torch.randn(9, 64)
    torch.testing.assert_close(cpu_rms_norm(norm, wide[:, :32]), norm(wide[:, :32].contiguous()))


class _Linear(nn.Module):
    """vLLM's linear layers' call contract: (output, bias) tuple; unquantized unless told."""

    def __init__(self, n_in: int, n_out: int, quant_method: object = None) -> None:
        super().__init__()
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        self.inner = nn.Linear(n_in, n_out, bias=False)
        self.quant_method = quant_method or UnquantizedLinearMethod()

    def forward(self, x):
        return self.inner(x), None


def test_cpu_gated_mlp_equals_silu_and_mul(vllm_config):
    from vllm.model_executor.layers.activation import SiluAndMul

    torch.manual_seed(1)
    mlp = nn.Module()
    mlp.gate_up_proj, mlp.down_proj, mlp.act_fn = _Linear(48, 2 * 80), _Linear(80, 48), SiluAndMul()
    x = torch.randn(13, 48)
    gate_up, _ = mlp.gate_up_proj(x)
    want, _ = mlp.down_proj(SiluAndMul.forward_native(gate_up))
    torch.testing.assert_close(cpu_gated_mlp(mlp, x), want, rtol=0, atol=0)


def test_cpu_gated_mlp_runs_another_activation_as_the_module(vllm_config):
    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act_fn = nn.GELU()
            self.gate_up_proj, self.down_proj = _Linear(8, 8), _Linear(8, 8)

        def forward(self, x):
            return torch.full_like(x, 7.0)

    x = torch.randn(3, 8)
    assert torch.equal(cpu_gated_mlp(Other(), x), torch.full_like(x, 7.0))


def test_cpu_gated_mlp_leaves_a_quantized_down_proj_to_the_module(vllm_config):
    """vLLM may fuse a quantized down_proj's input quantization into the activation: the
    module's own forward runs."""
    from vllm.model_executor.layers.activation import SiluAndMul

    class Quantized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act_fn = SiluAndMul()
            self.gate_up_proj = _Linear(8, 16)
            self.down_proj = _Linear(8, 8, quant_method=object())

        def forward(self, x):
            return torch.full_like(x, 5.0)

    x = torch.randn(3, 8)
    assert torch.equal(cpu_gated_mlp(Quantized(), x), torch.full_like(x, 5.0))
