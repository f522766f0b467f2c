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

# config-file name -> catalogue entry ("attnres" is Block AttnRes, the paper's practical form)
CONFIG_NAMES = {("attnres" if name == "attnres-block" else name): name for name in SETTINGS}


def main() -> None:
    out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "configs")
    os.makedirs(out, exist_ok=True)
    jobs = [(size_name, mech_name, entry, size) for size_name, size in SIZES.items()
            for mech_name, entry in CONFIG_NAMES.items()]
    jobs.append((LONG_CONTEXT[0], "attnres", LONG_CONTEXT[1], LONG_CONTEXT[2]))
    for size_name, mech_name, entry, size in jobs:
        doc = {k: dict(v) for k, v in size.items()}
        doc["residual"] = residual_settings(entry, size["model"]["num_layers"])
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
