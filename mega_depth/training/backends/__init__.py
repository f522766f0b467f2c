"""Trainer backends: each supplies the step, save and load of one engine (see mega_depth/training/trainer.py).

- megatron.py: Megatron-core (TP, SP, PP 1F1B and interleaved, DP, distributed optimizer, recompute);
- deepspeed.py: the same Megatron-core model under the DeepSpeed engine (ZeRO 0-3, data parallel);
- mega_depth/xla/backend.py: the plain decoder under torch-xla SPMD, or eagerly on the CPU.
"""
