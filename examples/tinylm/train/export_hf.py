"""TinyLM weights as a Hugging Face Llama checkpoint (config.json + model.safetensors), built
locally from weights/*.safetensors: no hub. TinyLM is a Llama (MODEL.md): RMSNorm, NeoX
rotate_half RoPE (theta 1e6), SwiGLU, GQA, tied embeddings, no biases; head_dim 32 with
8 heads over a 128-wide model, which LlamaConfig takes as head_dim.

    python export_hf.py ../weights/tinylm.safetensors OUT_DIR

python/tests/test_tinylm_hf.py checks the exported model's logits against
data/reference_logits.txt (the PyTorch training model's) and the C++ engine's rows.
"""
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def hf_name(name: str) -> str:
    if name in NAMES:
        return NAMES[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{LAYER_NAMES[rest]}"


def export(src: str, out_dir: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with safe_open(src, framework="pt") as f:
        meta = json.loads(f.metadata()["config"])
        tensors = {hf_name(k): f.get_tensor(k).contiguous() for k in f.keys()}
    head = tensors.pop("lm_head.weight")  # tied: the embedding matrix (byte-identical in the file)
    if not torch.equal(head, tensors["model.embed_tokens.weight"]):
        raise ValueError(f"{src}: output.weight differs from tok_embeddings.weight; TinyLM ties them")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": meta["vocab_size"],
        "hidden_size": meta["d_model"],
        "intermediate_size": meta["ffn_dim"],
        "num_hidden_layers": meta["n_layers"],
        "num_attention_heads": meta["n_heads"],
        "num_key_value_heads": meta["n_kv_heads"],
        "head_dim": meta["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": meta.get("norm_eps", 1e-5),
        "rope_theta": meta["rope_theta"],
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: export_hf.py WEIGHTS.safetensors OUT_DIR")
    print(export(sys.argv[1], sys.argv[2]))
