"""Fixtures for snapshot tests: an EMBER_HOME per test, small models, a moto_server process for S3."""
import pytest
import torch

from tests.aws_emulator import aws_env, moto_server


@pytest.fixture(autouse=True)
def ember_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def mixed_state() -> dict[str, torch.Tensor]:
    """Every dtype the format stores, odd sizes, a scalar and an empty tensor."""
    g = torch.Generator().manual_seed(1)
    return {
        "f64": torch.randn(17, 3, generator=g, dtype=torch.float64),
        "f32": torch.randn(301, 257, generator=g),
        "f16": torch.randn(1000, generator=g).half(),
        "bf16": torch.randn(33, 4097, generator=g).bfloat16(),
        "f8": torch.randn(999, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.randint(-2**40, 2**40, (5, 7), generator=g),
        "i32": torch.randint(-2**31, 2**31 - 1, (123,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-2**15, 2**15 - 1, (77,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (70001,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (4096,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(999, generator=g) > 0.5,
        "c64": torch.randn(10, generator=g, dtype=torch.complex64),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.zeros(0, 4),
    }


def tiny_qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512)
    return Qwen3ForCausalLM(config).to(torch.bfloat16)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), t.reshape(-1).contiguous().view(torch.uint8)), name


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto_server process (the AWS API emulator) on a free port, for the whole session."""
    with moto_server() as url:
        yield url


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """Dummy credentials and the emulator's endpoint, as boto3 reads them from the environment."""
    for key, value in aws_env(s3_endpoint).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return s3_endpoint
