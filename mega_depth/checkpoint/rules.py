"""The checkpoint rules, written once for every trainer.

- A save fills iter_N.tmp/, then records mega_depth.json and the manifest, renames it to iter_N and replaces the
  pointer atomically: a kill at any moment leaves the previous checkpoint and pointer intact.
- Every checkpoint belongs to a run (a random id made when a run starts from scratch, inherited on resume).
  Pruning (--keep-last) removes only the saving run's own older checkpoints, the least recent first; another
  run's checkpoints in the same folder are never touched.
- A run started from scratch (no --load) into a --save folder that already holds checkpoints is refused, unless
  --overwrite-save says to write beside them.
- --load of a folder that does not exist yet, or is empty, starts from scratch and says so (Megatron-LM's rule,
  so that `--save X --load X` works on a job's first submission).
- --load of a save folder verifies the newest checkpoint against its manifest and falls back to the newest intact
  checkpoint of the same run, naming the damaged file. In the run's own --save folder a damaged checkpoint is
  quarantined (renamed iter_N.damaged-<time>, so it never counts as kept), and an interrupted save's iter_N.tmp is
  removed. --load of one iter_N directory never falls back. A checkpoint without its manifest is damaged, unless
  its metadata predates manifests (then it loads with a warning).
- Pruning never deletes a run's last verified checkpoint (the one it resumed from, or its last save that read
  back intact) until a newer save has been verified against its manifest: a save is verified when pruning would
  otherwise delete it, or when the run has none verified yet (about one verification every --keep-last saves).
- A save never replaces another run's checkpoint of the same step (refused, with nothing deleted); the same run's
  checkpoint of that step is replaced by a swap that a kill at any moment leaves recoverable (iter_N.replaced).
- The resume point is the most recently saved checkpoint of the pointer's run, so a pointer that lags its newest
  checkpoint (a kill, or a full disk, between the rename and the pointer's write) does not skip it.
- A full disk during a save removes the partial save, keeps every earlier checkpoint and says how much space is
  free and how much a checkpoint takes.
- One run writes into a --save folder at a time (checkpoint/lock.py).

Collective calls take `comm`: an object with `rank`, `barrier()` and `broadcast(obj)` (from rank 0).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import time
import uuid
from typing import Callable, List, Optional, Tuple

from mega_depth.checkpoint.manifest import CorruptCheckpoint, file_sha256, has_manifest, verify, write_manifest
from mega_depth.config import Config, ConfigError, to_dict
from mega_depth.model.config import architecture_fields, flag_name, option_flag

POINTER = "latest_checkpointed_iteration.txt"
META = "mega_depth.json"


class CheckpointError(ConfigError):
    """A checkpoint problem the user must act on (the message names the problem and the fix)."""


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


REPLACED = ".replaced"  # iter_N.replaced: the checkpoint a same-step save is swapping out (save, restore_replaced)


def is_one_checkpoint(path: str) -> bool:
    """Whether `path` names one checkpoint (its mega_depth.json, or an iter_N name), not a save folder: a save
    folder may itself be called iter_something."""
    return os.path.isfile(os.path.join(path, META)) or \
        re.fullmatch(r"iter_\d+", os.path.basename(os.path.normpath(path))) is not None


def interrupted_saves(root: str) -> List[str]:
    """iter_N.tmp directories: saves a kill interrupted (never checkpoints)."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root)
                  if n.startswith("iter_") and n.endswith(".tmp") and os.path.isdir(os.path.join(root, n)))


def list_checkpoints(root: str) -> List[Tuple[int, str]]:
    """Complete checkpoint directories (iter_N, not iter_N.tmp) of a save folder, by step."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit() and os.path.isdir(os.path.join(root, name)):
            out.append((int(name[5:]), os.path.join(root, name)))
    return sorted(out)


def stranded_copies(root: str) -> List[Tuple[int, str]]:
    """iter_N.replaced directories without their iter_N, by step: a same-step swap killed between its renames left
    the only copy of step N there (restore_replaced puts it back at its run's resume). The folder's checks count
    them as the checkpoints they are."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        step = name[5:-len(REPLACED)]
        if name.startswith("iter_") and name.endswith(REPLACED) and step.isdigit() and \
                not os.path.isdir(os.path.join(root, name[:-len(REPLACED)])):
            out.append((int(step), os.path.join(root, name)))
    return sorted(out)


def held_steps(root: str) -> List[Tuple[int, str]]:
    """Every copy of a step the folder holds, by step: its checkpoints and its stranded copies."""
    return sorted(list_checkpoints(root) + stranded_copies(root))


def read_pointer(root: str) -> Optional[int]:
    try:
        text = open(os.path.join(root, POINTER)).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def write_pointer(root: str, step: int) -> None:
    tmp = os.path.join(root, POINTER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, POINTER))


def read_meta(ckpt_dir: str) -> dict:
    """mega_depth.json of a checkpoint; CorruptCheckpoint if it is missing or unreadable."""
    try:
        with open(os.path.join(ckpt_dir, META)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{META} is missing") from None
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"{META} is unreadable ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(meta, dict) or "config" not in meta or "step" not in meta:
        raise CorruptCheckpoint(f"{META} lacks the step or the config")
    return meta


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def run_meta(cfg: Config, format: str, run_id: str, **extra) -> dict:
    """What a checkpoint records beside its tensors (mega_depth.json): its format, the run, the model's hash and the
    whole config, whose `model:` flags hold every field of the architecture record (DecoderConfig), and the
    tokenizer's sha256 (an export checks that the file at the recorded path is still the one trained with)."""
    tokenizer = cfg.data.tokenizer_model
    digest = file_sha256(tokenizer) if tokenizer and os.path.isfile(tokenizer) else None
    return {"format": format, "run_id": run_id, "config_hash": config_hash(cfg), "config": to_dict(cfg),
            "tokenizer_sha256": digest, **extra}


def config_hash(cfg: Config) -> str:
    """Identifies the model a checkpoint holds (shape and mechanism; not the layout or the schedule)."""
    record = cfg.decoder_config().to_dict()
    values = {key: record[key] for key in architecture_fields() + ["residual"]}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------------


def check_fresh_save(root: str, overwrite: bool) -> None:
    """A run starting from scratch must not write into a folder holding another run's checkpoints."""
    existing = held_steps(root)
    if existing and not overwrite:
        names = ", ".join(os.path.basename(p) for _, p in existing[-3:])
        raise CheckpointError(
            f"--save {root} already holds checkpoints of another run ({names}); continue that run with --load "
            f"{root}, or save this one to a new --save folder, or pass --overwrite-save to write beside them")


def check_steps_free(root: str, run_id: str, first: int, last: int) -> None:
    """Before training: another run's checkpoints at the steps this run may save (first..last: a save interval's, the
    last step's, a pre-emption's at any step) are refused now, not at the save that would meet one (`save` never
    replaces another run's checkpoint)."""
    clashes = [(s, p) for s, p in held_steps(root) if first <= s <= last and _run_of(p) != run_id]
    if clashes:
        names = ", ".join(os.path.basename(p) for _, p in clashes[:3]) + (", ..." if len(clashes) > 3 else "")
        raise CheckpointError(
            f"--save {root} holds checkpoints of another run at steps this run may save ({names}; this run saves "
            f"steps {first}-{last}): a checkpoint is named by its step, and a save never replaces another run's. "
            "Save this run to a new --save folder, or move those checkpoints aside")


def save(root: str, step: int, fill: Callable[[str], None], meta: dict, keep_last: int, comm,
         protect: Optional[str] = None, owner: Optional[Callable[[], None]] = None,
         replace_other: bool = False) -> Tuple[str, bool]:
    """Write one checkpoint atomically (collective). `fill(tmp_dir)` writes the format's own files on every
    rank; `meta` (format, run_id, config, ...) goes to mega_depth.json. `protect` (the run's last verified
    checkpoint: the one it resumed from, or its last save that verified) is pruned only once this save has been
    verified against its manifest; with none, this save is verified. `owner()` (collective) raises if the folder is
    no longer this run's (its lock): called before the save touches the folder and again before it commits, since
    the process may have been frozen in between. Another run's checkpoint of the same step is refused before
    anything is written, unless `replace_other` (a forced import). Returns (the final directory, whether it was
    verified). A full disk raises CheckpointError after removing the partial save."""
    final = iter_dir(root, step)
    tmp = final + ".tmp"
    owner = owner or (lambda: None)
    owner()
    clash = None
    # step N as the folder holds it: iter_N, or the only copy a killed swap left (iter_N.replaced)
    held = final if os.path.isdir(final) else final + REPLACED if os.path.isdir(final + REPLACED) else None
    if comm.rank == 0 and not replace_other and held is not None:
        other = _run_of(held)
        if other != meta.get("run_id"):
            clash = (f"--save {root} already holds {os.path.basename(held)} of run {other or '(unreadable)'}, and "
                     f"this run ({meta.get('run_id')}) would replace it: a save never deletes another run's "
                     "checkpoint. Save this run to another --save folder, or move that checkpoint aside")
    if comm.any(clash is not None):
        raise CheckpointError(clash or f"saving checkpoint {step} into {root} was refused on rank 0 (see its message)")
    if comm.rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a previous kill mid-save
        os.makedirs(tmp)
    comm.barrier()
    failure = None
    try:
        fill(tmp)
        if os.environ.get("MEGA_DEPTH_FAULT_SLOW_SAVE_S"):  # fault injection: a save as slow as a large model's
            time.sleep(float(os.environ["MEGA_DEPTH_FAULT_SLOW_SAVE_S"]))
        if os.environ.get("MEGA_DEPTH_FAULT_DISK_FULL_IN_SAVE") == str(step):  # fault injection (tests)
            with open(os.path.join(tmp, "partial.bin"), "wb") as f:
                f.write(b"\0" * 1024)
            raise OSError(errno.ENOSPC, "No space left on device")
    except WRITE_ERRORS as exc:
        failure = disk_full(exc, root)
        if failure is None:
            raise
    if comm.any(failure is not None):
        _abandon(tmp, comm)
        raise CheckpointError(failure or f"saving checkpoint {step} into {root} failed on another rank (see its "
                              "message); the earlier checkpoints are intact")
    comm.barrier()
    if os.environ.get("MEGA_DEPTH_FAULT_KILL_IN_SAVE") == str(step):  # fault injection for the crash tests
        _kill_self()
    if os.environ.get("MEGA_DEPTH_FAULT_SIGTERM_IN_SAVE") == str(step):  # fault injection: a pre-emption mid-save
        os.kill(os.getpid(), signal.SIGTERM)
    owner()
    verified = False
    if comm.rank == 0:
        record = dict(meta, step=step, saved_at=time.time(), manifest=True)
        try:
            with open(os.path.join(tmp, META), "w") as f:
                json.dump(record, f, indent=1)
            write_manifest(tmp, record["run_id"], record.get("config_hash", ""))
        except OSError as exc:
            failure = disk_full(exc, root)
            if failure is None:
                raise
    if comm.any(failure is not None):
        _abandon(tmp, comm)
        raise CheckpointError(failure or f"saving checkpoint {step} into {root} failed on rank 0")
    if comm.rank == 0:
        _commit(tmp, final)
        try:
            write_pointer(root, step)
        except OSError as exc:  # the checkpoint is complete; a resume finds it from the folders (find_checkpoint)
            failure = disk_full(exc, root) or (
                f"saving into {root}: checkpoint {os.path.basename(final)} is complete, but writing {POINTER} failed "
                f"({exc.strerror or exc}); a resume from {root} finds it all the same. Fix the folder, and resume")
    if comm.any(failure is not None):  # (every rank raises: rank 0 alone would leave the others at a barrier)
        raise CheckpointError(failure or f"saving checkpoint {step} into {root} failed on rank 0")
    if comm.rank == 0:
        verified = _prune_after(root, final, keep_last, record["run_id"], protect)
    comm.barrier()
    return final, bool(comm.broadcast(verified))


def _commit(tmp: str, final: str) -> None:
    """tmp -> final. Where final exists (the same run saving a step again: a rewound run), the old one is swapped
    out first, not deleted first: a kill between the renames leaves it as iter_N.replaced, which the next resume
    puts back (restore_replaced)."""
    if not os.path.isdir(final):
        os.rename(tmp, final)
        return
    replaced = final + REPLACED
    shutil.rmtree(replaced, ignore_errors=True)  # (a kill after an earlier swap's second rename)
    os.rename(final, replaced)
    os.rename(tmp, final)
    shutil.rmtree(replaced, ignore_errors=True)


def _prune_after(root: str, final: str, keep_last: int, run_id: str, protect: Optional[str]) -> bool:
    """Prune after the save of `final`, never deleting the run's last verified checkpoint `protect` before `final`
    verifies; `final` is verified where pruning would delete `protect`, or where there is none (nothing verified
    yet). A save that reads back wrong prunes nothing. -> whether `final` was verified."""
    final = os.path.realpath(final)
    protect = os.path.realpath(protect) if protect is not None else None
    if protect is not None and (os.path.dirname(protect) != os.path.dirname(final) or protect == final):
        protect = None  # resumed from another folder, or its copy just replaced: nothing verified here now
    doomed = prune(root, keep_last, run_id, keep={final}, dry_run=True)
    if protect is not None and protect not in doomed:
        prune(root, keep_last, run_id, keep={final, protect})
        return False
    try:
        verify(final)
    except CorruptCheckpoint:
        return False  # keep everything: the older checkpoints are the ones left to fall back to
    prune(root, keep_last, run_id, keep={final})
    return True


def _checkpoint_exception():
    try:  # torch's dist-checkpoint writer wraps each rank's failure in this (a BaseException, not an Exception)
        from torch.distributed.checkpoint.api import CheckpointException
        return CheckpointException
    except ImportError:
        return OSError


# What a writer raises when the disk fills: OSError (ENOSPC), torch's dist-checkpoint CheckpointException or
# RuntimeError ("unexpected pos"), safetensors' SafetensorError ("os error 28"), ...: judged by disk_full.
WRITE_ERRORS = (Exception, _checkpoint_exception())
_FULL_DISK_TEXTS = ("No space left on device", "os error 28", "Disk quota exceeded", "unexpected pos",
                    "file write failed")


def disk_full(exc: BaseException, root: str) -> Optional[str]:
    """The one-line message for a write that ran out of space, or None if `exc` is something else. An OSError says
    so (ENOSPC, EDQUOT); other writers only say it in their text (torch's dist-checkpoint writer: "unexpected pos";
    safetensors: "os error 28"), taken as a full disk when little is free."""
    free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
    previous = list_checkpoints(root)
    size = _size(previous[-1][1]) if previous else 0
    enospc = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    said = any(s in text for s in _FULL_DISK_TEXTS)
    if not (enospc or (said and free < max(size, 1 << 20))):
        return None
    reason = exc.strerror if enospc else next(s for s in _FULL_DISK_TEXTS if s in text)
    last = f"checkpoint {os.path.basename(previous[-1][1])} is intact" if previous else "no earlier checkpoint"
    needed = f"the last checkpoint took {_human(size)}" if size else "a checkpoint needs room for every shard"
    return (f"the disk is full: saving into {root} failed ({reason}) with {_human(free)} free, and {needed}; "
            f"{last}. Free space, or save elsewhere (--save), and resume")


def _abandon(tmp: str, comm) -> None:
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # the partial save: free what it took


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _kill_self() -> None:
    """SIGKILL this process and its helpers (the checkpoint writer's worker processes), as an OOM kill would."""
    import signal

    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def prune(root: str, keep_last: int, run_id: str, keep=(), dry_run: bool = False) -> List[str]:
    """Delete this run's checkpoints beyond the `keep_last` most recently saved ones; returns what was deleted
    (real paths; with dry_run, what would be, deleting nothing). Checkpoints of other runs, unreadable ones and
    those in `keep` (paths in any spelling) are never deleted."""
    keep = {os.path.realpath(k) for k in ([keep] if isinstance(keep, str) else keep)}
    own = []
    for _, path in list_checkpoints(root):
        try:
            meta = read_meta(path)
        except CorruptCheckpoint:
            continue
        if meta.get("run_id") == run_id:
            own.append((meta.get("saved_at", 0.0), path))
    own.sort(reverse=True)
    deleted = []
    for _, path in own[keep_last:]:
        path = os.path.realpath(path)
        if path not in keep:
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)
            deleted.append(path)
    return deleted


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------


def predates_manifests(meta: dict) -> bool:
    """Metadata written before checkpoints carried a manifest (manifests came with the config hash)."""
    return "config_hash" not in meta and "manifest" not in meta


def _checked(ckpt_dir: str, say: Callable[[str], None] = print) -> dict:
    """The checkpoint's metadata once its files match its manifest (CorruptCheckpoint otherwise). A missing
    manifest is damage, unless the metadata predates manifests."""
    if not os.path.isdir(ckpt_dir):
        raise CorruptCheckpoint("the directory is missing")
    meta = read_meta(ckpt_dir)
    if has_manifest(ckpt_dir):
        verify(ckpt_dir)
    elif predates_manifests(meta):
        meta["unverified"] = True
        say(f"warning: checkpoint {ckpt_dir} predates manifests: its files cannot be verified; loading it as it is")
    else:
        raise CorruptCheckpoint("manifest.json is missing (its files cannot be verified)")
    return meta


def quarantine(path: str, say: Callable[[str], None] = print) -> str:
    """Rename a damaged checkpoint aside (it never counts as kept, and stays for inspection)."""
    aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    os.rename(path, aside)
    say(f"quarantined the damaged checkpoint as {aside}")
    return aside


def _run_of(ckpt_dir: str) -> Optional[str]:
    """The run that saved a checkpoint, from its mega_depth.json, else its manifest; None where neither says."""
    for reader in (lambda: read_meta(ckpt_dir).get("run_id"),
                   lambda: json.load(open(os.path.join(ckpt_dir, "manifest.json"))).get("run_id")):
        try:
            run_id = reader()
        except (CorruptCheckpoint, OSError, ValueError, AttributeError):  # (AttributeError: JSON that is no object)
            continue
        if isinstance(run_id, str) and run_id:
            return run_id
    return None


def _unnamed_fallback(load: str, complete: List[Tuple[int, str]], anchor: int) -> Optional[str]:
    """Before falling back past a damaged `anchor` (the checkpoint tried first) whose files name no run: the run the
    fallback continues, checked safe. It is safe only where every other checkpoint of the folder is of one run and
    at a lower step: else the anchor may be another run's (a fresh run's save beside an older run's checkpoints, or
    a rewound run's, whose timeline the steps alone do not order), and a resume would continue the wrong one as this
    one. -> that run (None where no other checkpoint names one); raises CheckpointError naming what it found and the
    fix otherwise. Called before the anchor is quarantined: a refusal renames nothing."""
    runs: dict = {}
    later = []
    for step, path in reversed(complete):
        if step == anchor:
            continue
        if step > anchor:
            later.append(os.path.basename(path))
        run = _run_of(path)
        if run is not None:
            runs.setdefault(run, os.path.basename(path))
    if len(runs) < 2 and not later:
        return next(iter(runs), None)
    if len(runs) > 1:
        found = f"checkpoints of {len(runs)} runs (" + ", ".join(f"run {r} (newest {n})" for r, n in runs.items()) + ")"
    else:
        found = f"checkpoints at later steps ({', '.join(later[:3])}): it may be a fresh or rewound run's save"
    raise CheckpointError(
        f"the newest checkpoint {dict(complete)[anchor]} is damaged and names no run, and {load} holds {found}; the "
        f"newest intact one may be another run's: name the one to resume with --load {os.path.join(load, 'iter_N')}")


def find_checkpoint(load: str, say: Callable[[str], None] = print, own: bool = False
                    ) -> Optional[Tuple[str, dict]]:
    """(directory, metadata) of the checkpoint `--load` names, verified; None to start from scratch.
    own: `load` is this run's --save folder (locked by it): damaged checkpoints are quarantined there and
    interrupted saves removed. Not collective: call on one rank and broadcast (see resolve_load)."""
    if not os.path.exists(load) and is_one_checkpoint(load):  # a named step that is not there: never from scratch
        parent = os.path.dirname(os.path.normpath(load)) or "."
        there = [os.path.basename(p) for _, p in list_checkpoints(parent)] if os.path.isdir(parent) else []
        raise CheckpointError(
            f"--load {load} does not exist ({parent} holds " + (", ".join(there[-3:]) if there else "no checkpoint")
            + "); name an existing iter_N directory, or its save folder to resume the newest")
    if not os.path.exists(load) or (os.path.isdir(load) and not folder_contents(load)):
        say(f"--load {load} {'does not exist' if not os.path.exists(load) else 'holds nothing'} yet: starting from "
            "scratch")
        return None
    if is_one_checkpoint(load):
        try:  # one named checkpoint: never fall back
            return load, _checked(load, say)
        except CorruptCheckpoint as e:
            raise CheckpointError(f"checkpoint {load} is damaged: {e}; load another iter_N directory, or its save "
                                  "folder to fall back to the newest intact checkpoint") from None
    if own:
        restore_replaced(load, say)
    complete = list_checkpoints(load)
    pointer = read_pointer(load)
    leftovers = interrupted_saves(load)
    if not complete and leftovers:  # a run killed during its first save: nothing to resume
        names = ", ".join(os.path.basename(p) for p in leftovers)
        say(f"--load {load} holds only an interrupted save ({names}), no checkpoint: starting from scratch"
            + (" (removed it)" if own else ""))
        if own:
            for path in leftovers:
                shutil.rmtree(path, ignore_errors=True)
        return None
    if not complete:
        raise CheckpointError(f"--load {load} holds no checkpoint (no iter_N directories or {POINTER}); point it at "
                              "a --save folder or at one iter_N directory")
    by_step = dict(complete)
    candidates = resume_order(complete, pointer)
    # the first candidate's run, read before a quarantine renames it: a fallback past one that names none must stay
    # within one run (_unnamed_fallback; the others are its run's: resume_order)
    unnamed, fallback_run = _run_of(by_step[candidates[0]]) is None, None
    problems = []
    for step in candidates:
        path = by_step[step]
        try:
            meta = _checked(path, say)
        except CorruptCheckpoint as e:
            say(f"checkpoint {path} is damaged: {e}; trying the previous one")
            problems.append(f"{os.path.basename(path)}: {e}")
            if unnamed and step == candidates[0]:
                fallback_run = _unnamed_fallback(load, complete, step)
            if own:
                quarantine(path, say)
            continue
        if problems:
            damaged = os.path.basename(by_step[candidates[0]])
            say(f"falling back to {path}, the newest intact checkpoint of this run" if not unnamed else
                f"falling back to {path}, the newest intact checkpoint (of run {fallback_run}, the folder's only run, "
                f"all of it at earlier steps: the damaged {damaged} names none)" if fallback_run else
                f"falling back to {path}, the newest intact checkpoint (no checkpoint of the folder names a run: the "
                f"damaged {damaged} is the newest)")
        elif pointer in by_step and pointer != step:
            say(f"resuming {path}, saved after the checkpoint that {POINTER} names ({pointer}): the pointer lagged")
        if own and pointer != step:
            write_pointer(load, step)
        return path, meta
    raise CheckpointError(f"no intact checkpoint in {load} ({'; '.join(problems)}); start without --load, or "
                          "restore the files")


def resume_order(complete: List[Tuple[int, str]], pointer: Optional[int]) -> List[int]:
    """The steps to try, best first: the checkpoint the pointer names (or, with no valid pointer, the highest step),
    then the other checkpoints of its run, highest step first. Saves are renamed into place before the pointer is
    written, so a kill or a full disk in between leaves the pointer one save behind: a checkpoint of its run saved
    after the one it names comes first (the most recent first). A damaged anchor whose run cannot be read: every
    checkpoint, highest step first."""
    by_step = dict(complete)
    anchor = pointer if pointer in by_step else complete[-1][0]
    run_id = _run_of(by_step[anchor])
    if run_id is None:
        return [anchor] + [s for s, _ in reversed(complete) if s != anchor]
    rest = [s for s, p in reversed(complete) if s != anchor and _run_of(p) == run_id]
    saved_at = {s: _saved_at(by_step[s]) for s in [anchor] + rest}  # (each mega_depth.json read once here)
    anchor_at = saved_at[anchor]  # (-inf where its metadata cannot be read: it is tried first, and named)
    later = [] if anchor_at == float("-inf") else sorted(
        (s for s in rest if saved_at[s] > anchor_at), key=saved_at.get, reverse=True)
    return later + [anchor] + [s for s in rest if s not in later]


def _saved_at(ckpt_dir: str) -> float:
    try:
        return float(read_meta(ckpt_dir).get("saved_at", 0.0))
    except (CorruptCheckpoint, TypeError, ValueError):
        return float("-inf")


def restore_replaced(root: str, say: Callable[[str], None] = print) -> None:
    """In the run's own folder: finish or undo a same-step swap a kill interrupted (_commit). iter_N.replaced
    beside iter_N is the old copy, removed; alone, it is the only copy of step N, put back."""
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        if not (name.startswith("iter_") and name.endswith(REPLACED)):
            continue
        replaced, final = os.path.join(root, name), os.path.join(root, name[:-len(REPLACED)])
        if os.path.isdir(final):
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.rename(replaced, final)
            say(f"put back {final}: a save of the same step was killed while it replaced it")


def peek_metadata(load: str) -> Optional[Tuple[str, dict]]:
    """(directory, metadata) of the checkpoint `--load` would resume, reading only its mega_depth.json (no hashing;
    safe on every rank): the newest readable one of the folder, or the named iter_N directory. None: nothing yet."""
    if is_one_checkpoint(load):
        try:
            return load, read_meta(load)
        except CorruptCheckpoint as e:
            raise CheckpointError(f"checkpoint {load} is damaged: {e}") from None
    complete = list_checkpoints(load)
    steps = resume_order(complete, read_pointer(load)) if complete else []
    for step in steps:
        try:
            meta = read_meta(iter_dir(load, step))
        except CorruptCheckpoint:
            if step == steps[0] and _run_of(iter_dir(load, step)) is None:  # (as find_checkpoint's fallback)
                _unnamed_fallback(load, complete, step)
            continue
        return iter_dir(load, step), meta
    if complete:
        raise CheckpointError(f"no readable checkpoint metadata in {load}; restore the files")
    return None


def folder_contents(folder: str) -> List[str]:
    """What a folder holds, leaving out a save lock (a folder that holds only the lock is empty)."""
    from mega_depth.checkpoint.lock import LOCK

    return [n for n in os.listdir(folder) if not n.startswith(LOCK)]


def resolve_load(load: str, comm, own: bool = False) -> Optional[Tuple[str, dict]]:
    """find_checkpoint on rank 0, the same answer on every rank (collective)."""
    answer = None
    if comm.rank == 0:
        try:
            answer = ("ok", find_checkpoint(load, own=own))
        except CheckpointError as e:
            answer = ("error", str(e))
    kind, value = comm.broadcast(answer)
    if kind == "error":
        raise CheckpointError(value)
    return value


def architecture_model_fields() -> Tuple[str, ...]:
    """The `model:` flags that make the model: what --use-checkpoint-args takes from a checkpoint. Derived from the
    architecture record (DecoderConfig), in its order, so a new field is never missed."""
    return tuple(flag_name(name) for name in architecture_fields())


def check_compatible(meta: dict, cfg: Config, where: str) -> None:
    """The checkpoint's model and mechanism must be this run's (the parallel layout and schedule may differ): every
    field of the architecture record (DecoderConfig) and every option of the mechanism is compared."""
    from mega_depth.checkpoint.weights import saved_config

    saved = saved_config(meta).decoder_config().to_dict()
    now = cfg.decoder_config().to_dict()
    diffs = [f"{option_flag(flag_name(key))}: checkpoint {saved.get(key)!r}, this run {now[key]!r}"
             for key in architecture_fields() if saved.get(key) != now[key]]
    saved_r, now_r = saved["residual"], now["residual"]
    for key in sorted(set(saved_r) | set(now_r), key=lambda k: (k != "mechanism", k)):
        if saved_r.get(key) != now_r.get(key):
            diffs.append(f"{option_flag(key)}: checkpoint {saved_r.get(key)!r}, this run {now_r.get(key)!r}")
    if diffs:
        hashes = f" (model hash: checkpoint {meta.get('config_hash', '?')}, this run {config_hash(cfg)})"
        raise CheckpointError(f"checkpoint {where} was trained with a different model or mechanism{hashes}: "
                              + "; ".join(diffs) + ". Pass the checkpoint's flags (or its --config), or start "
                              "without --load.")


def describe(meta: dict) -> str:
    return json.dumps({k: meta.get(k) for k in ("format", "step", "run_id")})


def load_config_dict(meta: dict) -> dict:
    return meta["config"]


__all__ = ["CheckpointError", "CorruptCheckpoint", "META", "POINTER", "check_compatible", "check_fresh_save",
           "WRITE_ERRORS", "architecture_model_fields", "config_hash", "disk_full", "find_checkpoint",
           "interrupted_saves", "iter_dir", "list_checkpoints", "new_run_id", "predates_manifests", "prune",
           "quarantine", "read_meta", "read_pointer", "resolve_load", "run_meta", "save", "to_dict", "write_pointer"]
