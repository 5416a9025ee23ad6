"""Sharded, verified, fenced, asynchronous checkpoints that reshard on load.

Use::

    # root defaults to $ELASTIC_CHECKPOINT_DIR
    ckpt = Checkpointer(model=model, optimizer=opt, scheduler=sched)
    start = ckpt.restore()                       # 0 on a fresh start
    sampler.load_state_dict(ckpt.data_state or {})
    for step in range(start, steps):
        train_step()
        if step % 100 == 99:
            ckpt.save(step, data_state=sampler.state_dict())   # returns at once
    ckpt.close()                                 # waits for the last save

The contract of an async save: between ``save()`` and the next
``optimizer.step()`` the model's parameters (and the optimizer's state) must
not be modified in place except by the optimizer (no EMA or clipping of the
weights themselves in between). Their copy to CPU runs in the background, and
each optimizer's ``step()`` waits for it (a step pre-hook); a violation is
detected (the tensors' ``_version`` counters) and fails that save with
``CheckpointError``, never committing a torn copy.

What a checkpoint holds and how it reshards: :mod:`elastic.checkpoint.state`.
The directory layout, manifests and checksums: :mod:`elastic.checkpoint.layout`;
how they are computed while DCP writes and checked while it reads:
:mod:`elastic.checkpoint.dcp_io`.

Saving (every rank; one save in flight at a time, over a gloo group of its own)
-------------------------------------------------------------------------------
1. Stage: ``save()`` takes the state dict, copies the buffers and non-tensor
   values to CPU and returns; the background thread copies the parameters
   and optimizer state (the next ``optimizer.step()``, ``save()``, ``wait()``,
   ``restore()`` or ``close()`` waits for that copy), then checks their
   ``_version`` counters; all ranks gather the outcome, and a change fails the
   save on every rank before anything is written.
2. In the background, rank 0 removes stale temporaries and creates
   ``<root>/.tmp-step-<step>-round-<round>/``; every rank writes its DCP
   shards, its ``rank-<r>.pt`` and then ``manifest-<r>.json`` (each file's
   size and CRC-32, and each DCP item's CRC-32, all computed from the bytes
   as they are written: nothing is read back), all fsynced. Any rank's
   failure fails the save on every rank and rank 0 removes the temporary
   directory.
3. Every rank verifies its share of all files (manifests complete for the
   world size, ``.metadata`` present, every listed file with its size, its
   items consistent with its CRC-32). No file is re-read: right after the
   write a read comes from the page cache and shows the bytes the CRC-32s
   were taken from; restore checks what storage gives back.
4. Rank 0 renames the directory to ``<root>/step-<step:012d>/`` and fsyncs the
   root, then calls ``commit_log.commit(entry)``, and only after the log
   accepted it writes ``COMMITTED`` (json: step, round, world_size, path,
   time) into the directory, then writes the previous entry's marker if a
   crash had left it out, then prunes old checkpoints. The outcome is
   broadcast, so every rank's ``wait()`` or next ``save()`` raises the same
   error, or none. A save that failed (not a fenced one) is reported once,
   by rank 0, to ``commit_log.report_failure`` (under the agent, an event in
   the job's history naming the error and the checkpoint that stays).

   A ``step-<step>`` directory already in the way of the rename is moved aside
   only when it is a leftover (a save that crashed after its rename, a fenced
   one, or one this process's restore found unusable). One written by a newer
   round (its marker or manifests say so) makes the save fail with
   ``FencedError``: the saver is a zombie, and that directory may be committed
   or about to be. One that restore may load (the latest entry's, or a marked
   one not newer than it) makes it fail with ``CheckpointWriteError``. Either
   way that directory is left byte for byte as it was.

The marker follows the commit log, not the other way round, so that a marker
always means "this was committed": a zombie of an old round that loses the
fence, or a crash between the rename and the log, leaves an unmarked
directory that nothing will load, and no cleanup after losing the fence is
needed (a cleanup by path after losing it could hit a directory the current
round has put there since).

What restore trusts (the rule)
------------------------------
Let L be ``commit_log.latest()``. Restore tries, in this order:

1. L's directory, with or without a marker (the log is the authority; the
   marker may be missing after a crash right after the log's commit);
2. then every directory that carries a ``COMMITTED`` marker and is older
   than L, newest first (with no L: every marked directory, newest first).

It loads the first one that verifies (complete manifests, ``.metadata``,
every listed file with its recorded size, and the CRC-32 of everything the
load reads). The cheap checks (manifests, sizes; each rank a share of the
files, balanced by bytes) come first; then ``dcp.load`` loads the candidate
through a reader that checks each DCP item's CRC-32 as it reads the item
(:mod:`elastic.checkpoint.dcp_io`), so the check costs no read of its own;
``.metadata`` and the rank's ``rank-<r>.pt`` are checked whole. Resharding
reads whole items too, so every item a restore uses is checked by the rank
that reads it. (Shard files of older checkpoints, whose manifests have no
item CRC-32s, are checked whole by a pass in a background thread during the
load, each rank a share.) The candidate is accepted only if every rank's
checks passed (gathered); otherwise the next candidate is loaded over it. So
the model's state is only valid once ``restore()`` returns. Each failed
candidate is logged as a warning naming the file (and the item) at fault.
What the load unpickles (``.metadata``, DCP's objects, ``rank-<r>.pt``) goes
through allow-lists (:mod:`elastic.checkpoint.trust`); a candidate that needs
another type fails the restore naming it (never a fallback in silence).
With ``verify_checksums=False`` only the cheap checks run, and the same reader
loads without CRC-32s (still only files the manifests list). A
directory newer than L is never loaded, marked or not. Rank 0 lists the
candidates and broadcasts them; the verification results are gathered on
every rank, so all ranks load the same one. Committed
checkpoints that all fail verification raise ``CheckpointCorruptError``
rather than silently starting from step 0; no checkpoint at all returns 0.

The invariant: the previous commit-log entry's directory is never written,
renamed or deleted by a later save until a newer entry has replaced it (and
retention always keeps the latest entry and the newest ``keep`` committed
ones), so a crash at any point leaves the previous committed checkpoint
intact and loadable, and nothing committed is lost.

Retention and cleanup (rank 0)
------------------------------
After each commit: keep the newest ``keep`` committed directories and the
latest entry's; delete older ones and unmarked directories newer than the
latest entry (see :func:`layout.retention_victims`). At the start of each
save: delete ``.trash-*`` and temporaries of older rounds or of this round's
older steps. Deletion is a rename to ``.trash-*`` first, so a half-deleted
directory is never mistaken for a checkpoint.

Failpoints (``ELASTIC_FAILPOINT``, see :mod:`elastic.failpoints`):
``ckpt.stage`` (in the background copy of an async save), ``ckpt.before_shards``
(before the temporary directory exists), ``ckpt.write`` (in it, before this rank's
first file), ``ckpt.mid_write``, ``ckpt.after_shards_before_commit``,
``ckpt.after_rename_before_commit_log``, ``ckpt.after_commit_log_before_marker``,
``ckpt.mid_prune`` (a pruned checkpoint renamed to ``.trash-*``, not yet deleted).

The memory tier (:mod:`elastic.checkpoint.memory`)
-------------------------------------------------
Under the agent's ``--memory-tier`` (``$ELASTIC_MEMORY_DIR``) or with
``memory_dir=``, and with ``data=`` (the sampler or loader whose position each
snapshot takes), the Checkpointer also snapshots each rank's state into host
memory at ``elastic.step`` every k steps (``memory_every``, "auto": k keeps the
cost under 1% of a step), with no collective per step; the agent replicates
each node's snapshots to a buddy node and frees older rounds'. ``restore()``
tries memory first: the newest snapshot complete for every rank of one round,
not older than the disk commit (by round, then step), read in place, sent by a
peer rank that holds it, or resharded through a DCP reader; anything else, or
any failure of that path, is the disk restore above.

The commit logs (``api``, ``commit``, ``etcd_log``, ``agent_log``) and
``layout`` import without torch, so the agent and elasticctl can read commit
logs and layouts; :class:`Checkpointer` and the modules it is made of (see
:mod:`elastic.checkpoint.checkpointer`) need torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elastic.checkpoint.api import CommitEntry, CommitLog
from elastic.checkpoint.commit import FileCommitLog
from elastic.checkpoint.etcd_log import EtcdCommitLog
from elastic.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError

if TYPE_CHECKING:
    from elastic.checkpoint.checkpointer import Checkpointer

__all__ = [
    "Checkpointer",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointWriteError",
    "CommitEntry",
    "CommitLog",
    "EtcdCommitLog",
    "FileCommitLog",
]


def __getattr__(name: str) -> Any:
    # Checkpointer needs torch; import it on first use so the control plane never does.
    if name == "Checkpointer":
        from elastic.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
