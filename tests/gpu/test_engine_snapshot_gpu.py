"""The engine on a CUDA GPU restores its bf16 weights from a snapshot: first boot captures, the next restores
into the CUDA tensors through pinned buffers, and serves the same greedy tokens."""
import pytest
import torch

from ember.runtime.engine.config import EngineConfig
from ember.runtime.engine.engine import LLMEngine
from ember.runtime.engine.sampling import SamplingParams
from ember.snapshot import LocalStore

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def boot(model_dir: str) -> LLMEngine:
    # The configuration of test_engine_gpu.py, so the same flashinfer kernels serve (compiled once per machine).
    return LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", num_kv_blocks=8192, max_num_seqs=128,
                                  max_num_batched_tokens=4096, max_model_len=1024, attention_backend="flashinfer",
                                  snapshot_store="local"))


def test_second_boot_restores_cuda_weights_from_the_snapshot(tmp_path, home_with_kept_kernels):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128, vocab_size=8192, max_position_embeddings=1024,
                         initializer_range=0.05, eos_token_id=2)
    model_dir = tmp_path / "qwen3"
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    prompts = [torch.randint(3, 8192, (n,)).tolist() for n in (5, 40, 200)]

    first = boot(str(model_dir))
    assert first.runner.weights_start.source == "full" and first.runner.weights_start.captured is not None
    expected = first.generate(prompts, GREEDY)
    del first
    torch.cuda.empty_cache()

    second = boot(str(model_dir))
    start = second.runner.weights_start
    assert start.source == "snapshot" and start.load.device.startswith("cuda"), start
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in second.runner.model.parameters())
    print(f"\nrestored {start.load}")
    assert second.generate(prompts, GREEDY) == expected
    assert len(LocalStore().ls()) == 1


def test_a_full_boot_builds_flashinfer_s_decode_module_before_any_request(tmp_path, home_with_kept_kernels):
    """Graphs of more than 8 sequences run flashinfer's decode module; a full boot builds (and keeps) it in its
    warm-up, so no request step of nine or more sequences compiles it. In a fresh process: the module cache is
    per process."""
    import os
    import subprocess
    import sys

    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=128, vocab_size=8192, max_position_embeddings=1024)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "qwen3")
    probe = ("import sys; from ember.runtime.engine.config import EngineConfig; "
             "from ember.runtime.engine.engine import LLMEngine; "
             "LLMEngine(EngineConfig(model=sys.argv[1], dtype='bfloat16', num_kv_blocks=1024, max_model_len=1024)); "
             "import flashinfer.decode as d; "
             "print('decode modules loaded:', d.get_batch_decode_module.cache_info().currsize)")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "qwen3")], capture_output=True, text=True,
                         env=os.environ | {"EMBER_HOME": str(home_with_kept_kernels)}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decode modules loaded: 1" in out.stdout, out.stdout + out.stderr[-3000:]
