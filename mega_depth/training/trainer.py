"""The one training loop, for every backend (Megatron-core and DeepSpeed: training/backends/; plain/XLA:
xla/backend.py).

Written once here: data order, resuming, the NaN policy, evaluation, logging (metrics.jsonl, TensorBoard, depth
heatmaps, MoE routing), SIGTERM save-and-exit, and the checkpoint rules (mega_depth/checkpoint/rules.py). A backend
supplies what training/backend.py's `Backend` protocol lists: collectives, how it reads the global batch, build,
forward_backward / update / discard, evaluation and probes, and its checkpoint files.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import List

from mega_depth.checkpoint import rules
from mega_depth.config import Config, ConfigError
from mega_depth.training import report
from mega_depth.training.logger import Logger, check_output_dir

FAULT_NAN_AT_STEP = "MEGA_DEPTH_FAULT_NAN_AT_STEP"  # fault injection: a NaN loss (and grads) at this step


class NonFiniteLoss(RuntimeError):
    pass


class Preemption:
    """SIGTERM (a scheduler's pre-emption notice) sets a flag; the loop saves and exits at the next step end."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


class Trainer:
    def __init__(self, cfg: Config, backend):
        self.cfg, self.backend = cfg, backend
        self.say = (lambda msg: print(msg, flush=True)) if backend.rank == 0 else (lambda msg: None)

    # --- start ----------------------------------------------------------------------------------------------------
    def _lock_save_folder(self):
        """The --save folder's lock, taken on rank 0 (collective; a held folder is an error on every rank)."""
        from mega_depth.checkpoint.lock import SaveFolderLocked, SaveLock

        ck, b = self.cfg.checkpoint, self.backend
        if not ck.save:
            return None
        lock, error = None, None
        if b.rank == 0:
            try:
                lock = SaveLock(ck.save, "starting", "training", self.say).acquire()
            except SaveFolderLocked as e:
                error = str(e)
        error = b.broadcast(error)
        if error:
            raise rules.CheckpointError(error)
        return lock

    def _check_lock(self, lock, verify: bool) -> None:
        """Collective: stop with one line if rank 0's lock no longer holds this run's token (found by its heartbeat,
        or with `verify` read now, within a save), so that this run does not write beside the folder's new holder."""
        lost = None
        if lock is not None:
            lost = lock.verify() if verify else lock.lost
        lost = self.backend.broadcast(lost)
        if lost:
            raise self._lost_lock(lost)

    def _stop_asked(self, preemption: Preemption, lock) -> bool:
        """Collective, one a step for both: a pre-emption on any rank, or a lock rank 0's heartbeat found lost."""
        return self.backend.any(preemption.requested or (lock is not None and lock.lost is not None))

    def _lost_lock(self, lost: str) -> Exception:
        save = self.cfg.checkpoint.save
        last = rules.read_pointer(save)
        kept = f"its last checkpoint {rules.iter_dir(save, last)} is intact" if last else "it saved nothing"
        return rules.CheckpointError(
            f"--save {save}: this run no longer holds the folder's lock ({lost}), so it stops without writing; "
            f"{kept}. Another run may be saving there: let it finish, or resume this run with another --save")

    def _save(self, lock, step: int, meta: dict, protect):
        """rules.save under the folder's lock: checked before the save and before it commits; a save that fails
        because the folder changed hands meanwhile (a frozen run's partial save removed by the new holder) ends
        with the lock's line, not the writer's traceback."""
        b, ck = self.backend, self.cfg.checkpoint
        try:
            return rules.save(ck.save, step, lambda tmp: b.save_files(tmp, step), meta, ck.keep_last, b,
                              protect=protect, owner=lambda: self._check_lock(lock, verify=True))
        except rules.CheckpointError:
            raise
        except rules.WRITE_ERRORS:
            lost = lock.verify() if lock is not None else None
            if lost:
                raise self._lost_lock(lost) from None
            raise

    def _resume_point(self):
        """(checkpoint dir, meta) to resume from, or None; refuses a stale --save folder for a fresh run."""
        ck, b = self.cfg.checkpoint, self.backend
        own = bool(ck.save) and ck.load is not None and os.path.realpath(ck.load) == os.path.realpath(ck.save)
        found = rules.resolve_load(ck.load, b, own=own) if ck.load else None
        if found is not None:
            ckpt, meta = found
            rules.check_compatible(meta, self.cfg, ckpt)
            if meta.get("format", "megatron") != b.format and not meta.get("model_only"):
                raise rules.CheckpointError(
                    f"--load {ckpt} was written by the {meta.get('format', 'megatron')} trainer, this run uses the "
                    f"{b.format} one; resume it with that trainer, or start from its weights: python "
                    f"tools/convert_from_hf.py --hf {ckpt} --save DIR, then --load DIR")
        if ck.save and (found is None or found[1].get("model_only")):
            self._on_rank0(lambda: rules.check_fresh_save(ck.save, ck.overwrite_save), rules.CheckpointError)
        return found

    def _on_rank0(self, check, error_type=ConfigError) -> None:
        """Collective: `check()` on rank 0 (the file system is judged once); its ConfigError stops every rank with
        the same line."""
        error = None
        if self.backend.rank == 0:
            try:
                check()
            except ConfigError as e:
                error = str(e)
        error = self.backend.broadcast(error)
        if error:
            raise error_type(error)

    def _check_outputs(self, found, run_id: str) -> None:
        """Collective, before the build (a refusal costs nothing), judged with the run id and the step this run
        will have: refuse (one line) an --output-dir that holds another run's records (logger.check_output_dir),
        and a --save folder where another run's checkpoints sit at steps this run may save
        (rules.check_steps_free: a save never replaces them)."""
        resumed = found is not None and not found[1].get("model_only")
        run = found[1].get("run_id", run_id) if resumed else run_id
        step = int(found[1].get("step", 0)) if resumed else 0
        self._on_rank0(lambda: check_output_dir(self.cfg, run, step))
        save = self.cfg.checkpoint.save
        if save:
            self._on_rank0(lambda: rules.check_steps_free(save, run, step + 1, self.cfg.training.train_iters),
                           rules.CheckpointError)

    def _samplers(self, start: int = 0, consumed: int = 0):
        """Training and validation samplers (validation: None where the run does not evaluate, see evaluates). The
        count of samples asked for (those consumed so far and those the remaining steps take) sizes a weighted
        blend only; any other data is one epoch of megatron's index, whatever the count (build_datasets)."""
        from mega_depth.data.datasets import GlobalBatchSampler, build_datasets, tokenizer_for

        cfg, (mbs, nmb, dp, dp_rank) = self.cfg, self.backend.sampler_shape
        gbs = mbs * nmb * dp
        evaluating = evaluates(cfg)
        needed = consumed + max(cfg.training.train_iters - start, 0) * gbs
        train_ds, valid_ds, _ = build_datasets(cfg, tokenizer_for(cfg), (max(needed, gbs),
                                                                          cfg.data.eval_iters * gbs if evaluating
                                                                          else None, None))
        train = GlobalBatchSampler(train_ds, mbs, nmb, dp, dp_rank)
        valid = None
        if evaluating:
            if valid_ds is None:
                raise ConfigError("--eval-interval needs a validation split: give --split with a non-zero second part")
            # Evaluation always samples the same batches, so validation losses compare across steps and runs.
            valid = GlobalBatchSampler(valid_ds, mbs, nmb, dp, dp_rank)
        return train, valid

    # --- one step -------------------------------------------------------------------------------------------------
    def step(self, microbatches, step: int) -> dict:
        """One optimizer step over a global batch. A non-finite loss stops the run or skips the update (--on-nan):
        the decision is taken on the loss every rank agrees on, before anything is applied."""
        b = self.backend
        lr = b.lr
        loss = b.forward_backward(microbatches, os.environ.get(FAULT_NAN_AT_STEP) == str(step))
        if not math.isfinite(loss):
            b.discard()
            if self.cfg.training.on_nan == "stop":
                raise NonFiniteLoss(f"loss is {loss} at step {step}; stopping (--on-nan stop). Resume from the last "
                                    "checkpoint with a lower --lr or --clip-grad, or use --on-nan skip")
            return {"loss": loss, "grad_norm": float("nan"), "lr": lr, "skipped": True}
        grad_norm, applied = b.update()
        from mega_depth.training.host_sync import intended

        with intended("the step's grad norm, for logging"):  # a device scalar from the Megatron backend
            grad_norm = float(grad_norm)
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": not applied}

    def evaluate(self, sampler) -> float:
        losses = [self.backend.evaluate(sampler.microbatches(i)) for i in range(self.cfg.data.eval_iters)]
        return sum(losses) / len(losses)

    # --- the loop -------------------------------------------------------------------------------------------------
    def run(self) -> List[dict]:
        if self.cfg.training.dry_run:
            return self._dry_run()
        preemption = Preemption()  # first: a SIGTERM while the model builds stops the run before its first step
        lock = None
        try:
            lock = self._lock_save_folder()  # before anything reads or writes --save
            return self._run(preemption, lock)
        finally:
            if lock is not None:
                lock.release()
            preemption.restore()

    def _summary(self, start: int, evaluating: bool) -> report.ModelCounts:
        """The start-up summary on rank 0; the model's counts for the interval line's MFU."""
        from mega_depth.data.datasets import training_tokens
        from mega_depth.init import padded_vocab_size

        cfg, b = self.cfg, self.backend
        counts = report.model_counts(cfg, padded_vocab_size(cfg.model.vocab_size))
        data_tokens = training_tokens(cfg) if b.rank == 0 else None
        for line in report.summary_lines(cfg, counts, b.layout(), b.sampler_shape, b.world_size, data_tokens, start,
                                         evaluating):
            self.say(line)
        return counts

    def _dry_run(self) -> List[dict]:
        """--dry-run of the XLA trainer (one SPMD program): build, print the summary and every rank's memory estimate,
        exit; nothing is written. The Megatron-core and DeepSpeed entry point sizes on the meta device instead,
        without a process group (training/dry_run.py)."""
        cfg, b = self.cfg, self.backend
        b.build(None)
        found = rules.peek_metadata(cfg.checkpoint.load) if cfg.checkpoint.load else None
        start = 0 if found is None or found[1].get("model_only") else int(found[1]["step"])
        self._summary(start, evaluates(cfg))
        dp = b.sampler_shape[2]
        # the depth state the mechanism carries past its last layer, in units of d per token (pipeline.py's payload)
        state = cfg.decoder_config().mechanism().layout(cfg.model.num_layers)
        units = sum(e.width for e in state) / cfg.model.hidden_size
        estimate = report.memory_estimate(cfg, b.parameters_on_rank(), dp, getattr(b, "zero_stage", 0), units,
                                          b.world_size)
        estimates = b.gather((b.rank, estimate))
        if b.rank == 0:
            rank, peak = max(estimates, key=lambda e: e[1].total)
            for line in report.memory_lines(peak):
                self.say(line + (f" [rank {rank}, the largest of {len(estimates)}]" if len(estimates) > 1 else ""))
            self.say("--dry-run: built and sized; no step taken, nothing written")
        return []

    def _run(self, preemption: Preemption, lock) -> List[dict]:
        cfg, b, ck = self.cfg, self.backend, self.cfg.checkpoint
        found = self._resume_point()
        start, run_id, consumed, resumed_from = 0, rules.new_run_id(), 0, None
        self._check_outputs(found, run_id)
        weights = None
        if found is not None and found[1].get("model_only"):
            from mega_depth.checkpoint.weights import full_megatron_weights

            weights = full_megatron_weights(*found)
        b.build(weights)
        if os.environ.get("MEGA_DEPTH_FAULT_SIGTERM_IN_BUILD"):  # fault injection: a pre-emption during start-up
            os.kill(os.getpid(), signal.SIGTERM)
        if found is not None:
            ckpt, meta = found
            if meta.get("model_only"):
                self.say(f"starting from the weights of {ckpt} at step 0 (weights-only checkpoint; new optimizer)")
            else:
                start, run_id = b.load(ckpt, meta), meta.get("run_id", run_id)
                consumed, resumed_from = consumed_samples(meta, start), ckpt
                self.say(f"resumed from {ckpt} at step {start} ({consumed} samples consumed)")
        run_id = b.broadcast(run_id)
        if lock is not None:
            lock.update(run_id)
        train, valid = self._samplers(start, consumed)
        counts = self._summary(start, valid is not None)
        from mega_depth.training.schedule import steps_at_zero_lr

        warning = steps_at_zero_lr(cfg, found[1]["config"].get("training") if resumed_from else None)
        if warning:
            self.say(warning)
        gbs, seq = train.global_batch_size, cfg.model.seq_length
        peak = b.peak_flops() if cfg.training.bf16 else None  # MFU is against the bf16 dense peak: none in fp32
        meter = report.IntervalMeter(cfg.training.train_iters, gbs * seq, counts.flops_per_token * gbs * seq, peak,
                                     b.world_size)
        logger, error = None, ""
        if b.rank == 0:
            try:
                logger = Logger(cfg, start, meter, run_id)
            except Exception as e:  # W&B's start, an unwritable --output-dir: every rank stops, not rank 0 alone
                error = f"could not start the run's logging: {type(e).__name__}: {e}"
        error = b.broadcast(error)
        if error:
            raise ConfigError(error)
        meta = rules.run_meta(cfg, b.format, run_id)
        history, train_time, last_routing = [], 0.0, None
        last_verified = resumed_from  # (verified when it was found: rules.find_checkpoint)
        try:
            # a SIGTERM during the start-up (building, loading, indexing the data): nothing new to save, and a
            # step and a save would only spend the scheduler's grace period
            if b.any(preemption.requested):
                self.say(f"exiting before step {start + 1} (SIGTERM during start-up): "
                         + (f"{resumed_from} stands" if resumed_from else "nothing trained, nothing saved"))
                return history
            for step in range(start, cfg.training.train_iters):
                done = step + 1
                last = done == cfg.training.train_iters
                t0 = time.perf_counter()
                result = self.step(train.microbatches_from(consumed), done)
                elapsed = time.perf_counter() - t0
                train_time += elapsed
                meter.add(elapsed)
                consumed += gbs  # a skipped step consumed its batch too (Megatron-LM's count)
                record = {"step": done, "loss": result["loss"], "lr": result["lr"], "grad_norm": result["grad_norm"],
                          "tokens_per_s": gbs * seq / elapsed, "consumed_samples": consumed,
                          "tokens": consumed * seq, "train_time_s": train_time}
                if result["skipped"]:
                    record["skipped"] = True
                routing = None
                if done % cfg.logging.log_interval == 0 or last:  # collective, on every rank alike
                    routing = b.moe_metrics()
                    if routing is not None:
                        record.update(report.routing_summary(routing))
                        last_routing = routing
                if valid is not None and ((cfg.data.eval_interval and done % cfg.data.eval_interval == 0) or last):
                    record["val_loss"] = self.evaluate(valid)
                    record["val_ppl"] = math.exp(min(record["val_loss"], 50.0))
                history.append(record)
                if logger is not None:
                    logger.step(record, b.memory_gb())
                    if routing is not None:
                        logger.routing(routing, done)
                every = cfg.logging.heatmap_interval
                if (every and done % every == 0) or (last and not every):
                    figures = b.heatmap_figures(train.microbatches_from(consumed - gbs))
                    paths = logger.heatmaps(figures, done) if figures and logger is not None else []
                    if last_routing is not None and logger is not None:  # beside them: the experts' load
                        paths = paths + [p for p in [logger.expert_load(last_routing["tokens_per_expert"], done)] if p]
                    if paths:
                        self.say(f"depth-weight heatmaps: {', '.join(paths)}")
                preempted = self._stop_asked(preemption, lock)
                if preempted:
                    self._check_lock(lock, verify=False)
                exiting = preempted or (cfg.training.exit_interval and done % cfg.training.exit_interval == 0)
                if ck.save and ((ck.save_interval and done % ck.save_interval == 0) or exiting or last):
                    path, verified = self._save(lock, done, dict(meta, layout=b.layout(), consumed_samples=consumed),
                                                last_verified)
                    if verified:  # it reads back intact: the one pruning keeps until a newer one does
                        last_verified = path
                    self.say(f"saved checkpoint {path}")
                    # a SIGTERM during a periodic save: that save is the one to stop on, not a step and a save later
                    if not exiting and not last and self._stop_asked(preemption, lock):
                        preempted = exiting = True
                        self._check_lock(lock, verify=False)
                if exiting:
                    self.say(f"exiting after step {done} ({'SIGTERM' if preempted else '--exit-interval'})")
                    break
        finally:
            if logger is not None:
                logger.close()
        return history


def evaluates(cfg) -> bool:
    """Whether the run evaluates: every --eval-interval steps and at the last step, or (no interval) at the last
    step wherever a validation split can give a sample (Megatron-LM evaluates at the end of training too).
    --eval-iters 0 turns evaluation off."""
    from mega_depth.data.datasets import validation_fits

    return bool(cfg.data.eval_iters) and (bool(cfg.data.eval_interval) or validation_fits(cfg))


def consumed_samples(meta: dict, step: int) -> int:
    """The samples a checkpoint's run had trained on: recorded since the data position counts samples; before,
    every step took the recorded global batch (or, where that was left to the default, one micro-batch per data-
    parallel rank)."""
    if "consumed_samples" in meta:
        return int(meta["consumed_samples"])
    training = meta.get("config", {}).get("training", {})
    gbs = training.get("global_batch_size")
    if gbs is None:
        gbs = training.get("micro_batch_size", 1) * max(1, int(meta.get("layout", {}).get("dp", 1)))
    return step * int(gbs)
