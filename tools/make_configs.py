"""Write launch/configs/<size>-<mechanism>.yaml for every model size and mechanism (rerun after edits here)."""

import os

import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mega_depth.catalogue import SETTINGS, residual_settings  # noqa: E402

SIZES = {
    # tiny: CPU quickstart on the embedded corpus (tools/quickstart.sh prepares data/processed/)
    "tiny": dict(
        model=dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, seq_length=128),
        training=dict(micro_batch_size=8, global_batch_size=16, train_iters=300, lr=3e-3, min_lr=3e-4,
                      lr_warmup_iters=30, lr_decay_style="cosine", weight_decay=0.1, clip_grad=1.0),
        data=dict(data_path=["data/processed/python-docs"], tokenizer_model="data/processed/spm.model",
                  split="95,5,0", eval_interval=100, eval_iters=4),
        checkpoint=dict(save="runs/tiny/checkpoints", save_interval=100),
        logging=dict(output_dir="runs/tiny", log_interval=10),
    ),
    "125m": dict(
        model=dict(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=2048),
        parallel=dict(use_distributed_optimizer=True),
        training=dict(micro_batch_size=8, global_batch_size=256, train_iters=100000, lr=6e-4, min_lr=6e-5,
                      lr_warmup_iters=2000, lr_decay_style="cosine", bf16=True),
        data=dict(split="969,30,1", eval_interval=1000, eval_iters=20),
        checkpoint=dict(save_interval=1000),
    ),
    "1b": dict(
        model=dict(num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=8, seq_length=4096),
        parallel=dict(use_distributed_optimizer=True, tensor_model_parallel_size=2, sequence_parallel=True),
        training=dict(micro_batch_size=2, global_batch_size=512, train_iters=200000, lr=3e-4, min_lr=3e-5,
                      lr_warmup_iters=2000, lr_decay_style="WSD", bf16=True),
        data=dict(split="969,30,1", eval_interval=1000, eval_iters=20),
        checkpoint=dict(save_interval=1000),
    ),
    "7b": dict(
        model=dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                   ffn_hidden_size=11008, seq_length=4096),
        parallel=dict(use_distributed_optimizer=True, tensor_model_parallel_size=4, sequence_parallel=True,
                      pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=4,
                      recompute_granularity="selective"),
        training=dict(micro_batch_size=1, global_batch_size=1024, train_iters=250000, lr=3e-4, min_lr=3e-5,
                      lr_warmup_iters=2000, lr_decay_style="cosine", bf16=True),
        data=dict(split="969,30,1", eval_interval=1000, eval_iters=20),
        checkpoint=dict(save_interval=500),
    ),
}

# A long-context phase for the 1B model (Block AttnRes, as Kimi K3): 32k tokens per sequence split over 4
# context-parallel ranks (x TP 2 = 8 GPUs per replica), 2M tokens per step, a larger RoPE base for the longer range.
LONG_CONTEXT = ("1b-long-context", "attnres-block", dict(
    model=dict(num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=8, seq_length=32768,
               rotary_base=500000),
    parallel=dict(use_distributed_optimizer=True, tensor_model_parallel_size=2, sequence_parallel=True,
                  context_parallel_size=4),
    training=dict(micro_batch_size=1, global_batch_size=64, train_iters=4000, lr=1e-4, min_lr=1e-5,
                  lr_warmup_iters=200, lr_decay_style="cosine", bf16=True),
    data=dict(split="969,30,1", eval_interval=500, eval_iters=10),
    checkpoint=dict(save_interval=250),
))

# Mixture of experts (name, catalogue entry, residual overrides, config). Tiny ones for the CPU (the quickstart's
# MECH=attnres-moe, a DeepSeek-style routing with mHC, a Qwen3-MoE-exportable standard residual) and two at about
# 1B active parameters: Kimi-K3-style (Block AttnRes in 12-layer blocks, a dense first layer) and
# DeepSeek-V4-style (mHC, three dense first layers, sigmoid routing with the expert bias and a shared expert).
_TINY_MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=192, moe_layer_freq="([0]*1+[1]*3)",
                 moe_aux_loss_coeff=0.01)
_DEEPSEEK_ROUTING = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                         moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4)
_1B_MOE = dict(
    model=dict(num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=5632,
               seq_length=4096, num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=512,
               moe_shared_expert_intermediate_size=512, moe_token_dispatcher_type="alltoall"),
    parallel=dict(use_distributed_optimizer=True, expert_model_parallel_size=8),
    training=dict(micro_batch_size=2, global_batch_size=512, train_iters=200000, lr=3e-4, min_lr=3e-5,
                  lr_warmup_iters=2000, lr_decay_style="WSD", bf16=True),
    data=dict(split="969,30,1", eval_interval=1000, eval_iters=20),
    checkpoint=dict(save_interval=1000),
)


def _with(base: dict, **sections) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, values in sections.items():
        out.setdefault(section, {}).update(values)
    return out


MOE_CONFIGS = [
    ("tiny", "attnres-moe", "attnres-block", {}, _with(SIZES["tiny"], model=_TINY_MOE)),
    ("tiny", "mhc-moe", "mhc", {}, _with(SIZES["tiny"], model=dict(
        _TINY_MOE, moe_shared_expert_intermediate_size=128, **_DEEPSEEK_ROUTING))),
    ("tiny", "standard-moe", "standard", {}, _with(SIZES["tiny"], model=_TINY_MOE)),
    ("1b", "k3-attnres-moe", "attnres-block", {"attnres_num_blocks": 2}, _with(_1B_MOE, model=dict(
        moe_layer_freq="([0]*1+[1]*23)", **_DEEPSEEK_ROUTING))),
    ("1b", "dsv4-mhc-moe", "mhc", {}, _with(_1B_MOE, model=dict(
        moe_layer_freq="([0]*3+[1]*21)", moe_router_topk=6, moe_ffn_hidden_size=640,
        moe_shared_expert_intermediate_size=1024, **_DEEPSEEK_ROUTING))),
]

# config-file name -> catalogue entry ("attnres" is Block AttnRes, the paper's practical form)
CONFIG_NAMES = {("attnres" if name == "attnres-block" else name): name for name in SETTINGS}


def main() -> None:
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "configs")
    os.makedirs(out, exist_ok=True)
    jobs = [(size_name, mech_name, entry, {}, size) for size_name, size in SIZES.items()
            for mech_name, entry in CONFIG_NAMES.items()]
    jobs.append((LONG_CONTEXT[0], "attnres", LONG_CONTEXT[1], {}, LONG_CONTEXT[2]))
    jobs += MOE_CONFIGS
    for size_name, mech_name, entry, overrides, size in jobs:
        doc = {k: dict(v) for k, v in size.items()}
        doc["residual"] = residual_settings(entry, size["model"]["num_layers"], **overrides)
        if "logging" in doc:
            doc["logging"]["output_dir"] = f"runs/{size_name}-{mech_name}"
        else:
            doc["logging"] = {"output_dir": f"runs/{size_name}-{mech_name}"}
        doc.setdefault("checkpoint", {})["save"] = f"runs/{size_name}-{mech_name}/checkpoints"
        path = os.path.join(out, f"{size_name}-{mech_name}.yaml")
        with open(path, "w") as f:
            f.write(f"# {size_name} {mech_name}: python -m mega_depth.train --config {os.path.relpath(path)}"
                    " [--flag value ...]\n")
            yaml.safe_dump(doc, f, sort_keys=False)
    print(f"wrote {len(jobs)} configs to {out}")


if __name__ == "__main__":
    main()
