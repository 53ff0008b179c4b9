"""The engine's layout of a Hugging Face checkpoint (snapshot/writer.py): merged projections, in place."""
from ember.snapshot.writer import engine_layout


def test_projections_merge_in_the_checkpoints_order_and_incomplete_ones_stay_apart():
    names = ["embed.weight",
             "layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight", "layers.0.attn.v_proj.weight",
             "layers.0.attn.q_proj.bias", "layers.0.attn.k_proj.bias", "layers.0.attn.v_proj.bias",
             "layers.0.mlp.up_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.down_proj.weight",
             "layers.1.attn.q_proj.weight", "layers.1.attn.k_proj.weight"]   # layer 1 has no v_proj
    assert engine_layout(names) == [
        ("embed.weight", ["embed.weight"]),
        ("layers.0.attn.qkv_proj.weight", [f"layers.0.attn.{p}_proj.weight" for p in "qkv"]),
        ("layers.0.attn.qkv_proj.bias", [f"layers.0.attn.{p}_proj.bias" for p in "qkv"]),
        # gate's rows come first whatever order the file lists them in
        ("layers.0.mlp.gate_up_proj.weight", ["layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"]),
        ("layers.0.mlp.down_proj.weight", ["layers.0.mlp.down_proj.weight"]),
        ("layers.1.attn.q_proj.weight", ["layers.1.attn.q_proj.weight"]),
        ("layers.1.attn.k_proj.weight", ["layers.1.attn.k_proj.weight"]),
    ]
