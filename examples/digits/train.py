"""The example training job: the MLP of ``model.py`` on the digits split of ``data.py``.

Everything comes from the environment gpuferry's contract describes (the variables, files and exit
codes below); run it as ``python train.py`` from this directory, or under torchrun. It imports
nothing of gpuferry. The trained model is saved as an MLflow model (``mlflow.pytorch``, with an input
example) in ``$CHECKPOINT_DIR/final/``: that is what gpuferry stores, registers and serves.

``HPARAMS`` (a JSON object; every key is optional; an unknown key is an error):

==============  =====  =======  ======================================================
key             type   default  meaning
==============  =====  =======  ======================================================
``epochs``      int    20       passes over the training split
``lr``          float  0.05     learning rate
``batch_size``  int    64       global batch size, split evenly across the ranks
``hidden``      int    128      hidden units of the MLP
``dropout``     float  0.0      dropout after the hidden layer
``seed``        int    0        seeds the initial weights, the data order and dropout
``optimizer``   str    "sgd"    ``"sgd"`` (momentum 0.9) or ``"adam"``
==============  =====  =======  ======================================================

One step is one optimizer step over a global batch, so ``total_steps = epochs *
ceil(n_train / batch_size)`` whatever the number of processes. The data order of an
epoch is a permutation drawn from ``(seed, epoch)``, which lets a resumed job skip the
batches an interrupted epoch had already done and carry on with the same samples; a
job resumed with the same number of processes reproduces the uninterrupted run exactly.

Besides ``model.pt``, a ``step-*`` checkpoint holds ``training_state.pt``: the optimizer
state, the position (step, epoch, next batch of the epoch), the hparams it was trained
with (resuming with other hparams is an error) and every rank's RNG state.
``CHECKPOINT_DIR`` defaults to ``./checkpoints``. In the progress file ``epoch`` counts
the finished epochs. A bad ``HPARAMS`` or ``CHECKPOINT_EVERY`` exits with code 2.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import data
import model as mlp


class contract:  # noqa: N801 - a namespace of the contract's names, read like a module
    """What gpuferry hands the job and reads back (its contract, written down in gpuferry's runtime/contract.py)."""

    CHECKPOINT_DIR = "CHECKPOINT_DIR"
    CHECKPOINT_EVERY = "CHECKPOINT_EVERY"
    HPARAMS = "HPARAMS"
    PROGRESS_FILE = "PROGRESS_FILE"
    MLFLOW_TRACKING_URI = "MLFLOW_TRACKING_URI"
    RANK, WORLD_SIZE, LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
    FINAL_DIRNAME = "final"  # the MLflow model, written last
    CHECKPOINT_PREFIX = "step-"
    PREEMPTED_MARKER = "PREEMPTED"
    EXIT_OK = 0
    EXIT_PREEMPTED = 75


MODEL_FILENAME = "model.pt"
TRAINING_STATE_FILENAME = "training_state.pt"
TMP_PREFIX = ".tmp-"
KEEP_CHECKPOINTS = 2
DEFAULT_CHECKPOINT_EVERY = 50
SGD_MOMENTUM = 0.9
OPTIMIZERS = ("sgd", "adam")
EXIT_USAGE = 2


class UsageError(Exception):
    """A bad setting in the environment: the job exits with ``EXIT_USAGE``."""


@dataclass(frozen=True)
class HParams:
    """The hyperparameters (see the module docstring), parsed from ``HPARAMS``."""

    epochs: int = 20
    lr: float = 0.05
    batch_size: int = 64
    hidden: int = 128
    dropout: float = 0.0
    seed: int = 0
    optimizer: str = "sgd"

    @classmethod
    def from_json(cls, text: str) -> HParams:
        try:
            raw = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise UsageError(f"{contract.HPARAMS} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise UsageError(f"{contract.HPARAMS} must be a JSON object, got {type(raw).__name__}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(raw) - set(valid))
        if unknown:
            raise UsageError(
                f"unknown key(s) in {contract.HPARAMS}: {', '.join(unknown)}; valid keys: {', '.join(valid)}"
            )
        values: dict[str, Any] = {}
        defaults = cls()
        for name, value in raw.items():
            expected = type(getattr(defaults, name))
            accepted = (int, float) if expected is float else expected
            # bool is an int subclass but never a sensible value for these keys.
            if isinstance(value, bool) or not isinstance(value, accepted):
                raise UsageError(f"{contract.HPARAMS}[{name!r}] must be {expected.__name__}, got {value!r}")
            values[name] = expected(value)
        hp = cls(**values)
        if min(hp.epochs, hp.batch_size, hp.hidden) < 1 or hp.lr <= 0 or not 0 <= hp.dropout < 1:
            raise UsageError(
                f"{contract.HPARAMS} out of range: need epochs, batch_size, hidden >= 1, lr > 0, "
                f"0 <= dropout < 1; got {asdict(hp)}"
            )
        if hp.optimizer not in OPTIMIZERS:
            raise UsageError(
                f"{contract.HPARAMS}['optimizer'] must be one of {OPTIMIZERS}, got {hp.optimizer!r}"
            )
        return hp

    @property
    def model_config(self) -> dict[str, Any]:
        return {"hidden": self.hidden, "dropout": self.dropout}


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class StopFlag:
    """Set by SIGTERM/SIGUSR1; the training loop checkpoints and exits at the next step."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


@dataclass
class Position:
    """Where training stands: ``batch`` is the next batch of ``epoch`` to train on."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def log(ranks: Ranks, message: str) -> None:
    if ranks.is_main:
        print(message, flush=True)


def setup_ranks() -> Ranks:
    world_size = int(os.environ.get(contract.WORLD_SIZE, "1"))
    rank = int(os.environ.get(contract.RANK, "0"))
    local_rank = int(os.environ.get(contract.LOCAL_RANK, "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    # One thread per process unless OMP_NUM_THREADS says otherwise: batches of a few dozen
    # 64-feature rows are far too small for intra-op parallelism to pay, and on a busy
    # machine the threads' barriers make a step several times slower than one thread.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    return Ranks(rank=rank, world_size=world_size, device=device)


# ---------------------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, payload: bytes | dict[str, Any]) -> None:
    """Write bytes, or ``torch.save`` a dict, to ``path`` and fsync it."""
    with open(path, "wb") as f:
        if isinstance(payload, bytes):
            f.write(payload)
        else:
            torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())


def _temporary_name(target: Path, tag: str = "") -> Path:
    """A sibling of ``target`` that ``remove_stale_temporaries`` cleans up after a crash."""
    return target.with_name(f"{TMP_PREFIX}{tag}{target.name}.{os.getpid()}")


def write_dir_atomically(target: Path, files: dict[str, bytes | dict[str, Any]]) -> None:
    """Create ``target`` holding ``files`` so that it is either absent or complete."""
    tmp = _temporary_name(target)
    tmp.mkdir()
    for name, payload in files.items():
        _write_durably(tmp / name, payload)
    _fsync_dir(tmp)
    old = None
    if target.exists():
        # A rename can't replace a non-empty directory: move the old one aside first.
        old = _temporary_name(target, "old-")
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)


def write_json_atomically(path: Path, obj: dict[str, Any]) -> None:
    tmp = _temporary_name(path)
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def checkpoint_dirs(root: Path) -> list[Path]:
    """The complete ``step-*`` checkpoints under ``root``, oldest first."""
    found = []
    for path in root.glob(contract.CHECKPOINT_PREFIX + "*"):
        suffix = path.name[len(contract.CHECKPOINT_PREFIX) :]
        complete = (path / MODEL_FILENAME).is_file() and (path / TRAINING_STATE_FILENAME).is_file()
        if suffix.isdigit() and complete:
            found.append((int(suffix), path))
    return [path for _, path in sorted(found)]


def remove_stale_temporaries(root: Path) -> None:
    """Drop what an interrupted atomic write left behind."""
    for path in root.glob(TMP_PREFIX + "*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


# ----------------------------------------------------------------------- data order


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def rank_batch(order: np.ndarray, batch: int, batch_size: int, ranks: Ranks) -> np.ndarray:
    """This rank's share of global batch ``batch`` of an epoch.

    Like DistributedSampler, a global batch that doesn't divide evenly is padded with
    samples from the start of the epoch, so every rank gets as many samples as the others
    and averaging the ranks' gradients is the gradient of the padded batch.
    """
    rows = order[batch * batch_size : (batch + 1) * batch_size]
    pad = -len(rows) % ranks.world_size
    if pad:
        rows = np.concatenate([rows, order[:pad]])
    return rows[ranks.rank :: ranks.world_size]


# ---------------------------------------------------------------------- checkpoints


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rank_rng(seed: int, ranks: Ranks, step: int) -> None:
    """Give each rank its own dropout stream, derived from the seed and the step."""
    torch.manual_seed(int(np.random.SeedSequence([seed, ranks.rank, step]).generate_state(1)[0]))


def model_payload(net: nn.Module, hp: HParams) -> dict[str, Any]:
    state_dict = {k: v.detach().cpu() for k, v in net.state_dict().items()}
    return {"state_dict": state_dict, "config": hp.model_config}


def save_checkpoint(
    root: Path, net: nn.Module, optimizer: torch.optim.Optimizer, hp: HParams, pos: Position, ranks: Ranks
) -> None:
    """Collective: every rank contributes its RNG state, rank 0 writes ``step-<N>/``."""
    local = rng_state(ranks.device)
    rng: list[Any] = [local]
    if ranks.distributed:
        rng = [None] * ranks.world_size
        dist.all_gather_object(rng, local)
    if not ranks.is_main:
        return
    state = {
        "optimizer": optimizer.state_dict(),
        **asdict(pos),
        "world_size": ranks.world_size,
        "hparams": asdict(hp),
        "rng": rng,
    }
    target = root / f"{contract.CHECKPOINT_PREFIX}{pos.step:08d}"
    files = {MODEL_FILENAME: model_payload(net, hp), TRAINING_STATE_FILENAME: state}
    write_dir_atomically(target, files)
    for stale in checkpoint_dirs(root)[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(stale, ignore_errors=True)


def save_mlflow_model(target: Path, net: nn.Module, example: np.ndarray) -> None:
    """Save the trained network as an MLflow model at ``target``, atomically (absent or complete).

    The served model answers class probabilities (a softmax on the logits), one row per input row.
    The input example has two rows: a one-row example would export a fixed batch size of 1.
    """
    import mlflow.pytorch

    served = nn.Sequential(net, nn.Softmax(dim=1)).cpu().eval()
    tmp = _temporary_name(target)
    # Naming the requirements spares MLflow inferring them (it loads the model in a subprocess for that).
    requirements = [f"torch=={torch.__version__.split('+')[0]}", f"numpy=={np.__version__}"]
    mlflow.pytorch.save_model(served, str(tmp), input_example=example, pip_requirements=requirements)
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = None
    if target.exists():
        old = _temporary_name(target, "old-")
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old)


def resume(
    root: Path, net: nn.Module, optimizer: torch.optim.Optimizer, hp: HParams, ranks: Ranks
) -> Position | None:
    """Load the newest checkpoint into ``net`` and ``optimizer``; None when there is none."""
    found = checkpoint_dirs(root)
    if not found:
        return None
    path = found[-1]
    # On the CPU: RNG states must stay there; the weights and the optimizer state are
    # copied to the parameters' device as they are loaded.
    weights = torch.load(path / MODEL_FILENAME, map_location="cpu", weights_only=True)
    state = torch.load(path / TRAINING_STATE_FILENAME, map_location="cpu", weights_only=True)
    if state["hparams"] != asdict(hp):
        raise UsageError(
            f"{path} was written with hparams {state['hparams']}, not {asdict(hp)}: "
            f"use a fresh {contract.CHECKPOINT_DIR} for different hyperparameters"
        )
    net.load_state_dict(weights["state_dict"])
    optimizer.load_state_dict(state["optimizer"])
    pos = Position(step=state["step"], epoch=state["epoch"], batch=state["batch"])
    if state["world_size"] == ranks.world_size:
        set_rng_state(state["rng"][ranks.rank], ranks.device)
    else:
        seed_rank_rng(hp.seed, ranks, pos.step)
    log(ranks, f"resumed from {path.name}: step {pos.step}, epoch {pos.epoch + 1}, batch {pos.batch}")
    return pos


# ------------------------------------------------------------------------ tracking


class Tracker:
    """MLflow logging from rank 0 when ``MLFLOW_TRACKING_URI`` is set; a no-op otherwise."""

    def __init__(self, hp: HParams, ranks: Ranks) -> None:
        self._mlflow: ModuleType | None = None
        if not (ranks.is_main and os.environ.get(contract.MLFLOW_TRACKING_URI)):
            return
        import mlflow

        self._mlflow = mlflow
        # With MLFLOW_RUN_ID set this attaches to that (the pipeline's) run.
        mlflow.start_run()
        # A resumed job logs the same params again, which MLflow accepts only when the
        # values are identical; the world size may change between attempts, so it's a tag.
        mlflow.log_params({k: str(v) for k, v in asdict(hp).items()})
        mlflow.set_tag("world_size", str(ranks.world_size))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._mlflow is not None:
            self._mlflow.log_metrics(metrics, step=step)

    def end(self, status: str) -> None:
        if self._mlflow is not None:
            self._mlflow.end_run(status=status)


# ------------------------------------------------------------------------ training


@torch.no_grad()
def evaluate(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Return ``(loss, accuracy)`` on ``(x, y)``."""
    was_training = net.training
    net.eval()
    logits = net(x)
    loss = F.cross_entropy(logits, y).item()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    net.train(was_training)
    return loss, accuracy


def any_rank(flag: bool, ranks: Ranks) -> bool:
    """True on every rank when ``flag`` is true on at least one."""
    if not ranks.distributed:
        return flag
    t = torch.tensor([int(flag)], device=ranks.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def make_optimizer(params: Any, hp: HParams) -> torch.optim.Optimizer:
    if hp.optimizer == "adam":
        return torch.optim.Adam(params, lr=hp.lr)
    return torch.optim.SGD(params, lr=hp.lr, momentum=SGD_MOMENTUM)


def train(hp: HParams, ranks: Ranks, stop: StopFlag) -> int:
    root = Path(os.environ.get(contract.CHECKPOINT_DIR, "checkpoints"))
    every_env = os.environ.get(contract.CHECKPOINT_EVERY) or str(DEFAULT_CHECKPOINT_EVERY)
    if not every_env.isdigit() or int(every_env) < 1:
        raise UsageError(f"{contract.CHECKPOINT_EVERY} must be a positive integer, got {every_env!r}")
    every = int(every_env)
    progress_env = os.environ.get(contract.PROGRESS_FILE)
    progress_file = Path(progress_env) if progress_env else None
    if ranks.is_main:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(root)
        (root / contract.PREEMPTED_MARKER).unlink(missing_ok=True)  # this run starts afresh or resumes
        if progress_file is not None:
            progress_file.parent.mkdir(parents=True, exist_ok=True)

    split = data.load_digits_split()
    tensors = {
        name: (torch.from_numpy(x).to(ranks.device), torch.from_numpy(y).to(ranks.device))
        for name, (x, y) in split.items()
    }
    x_train, y_train = tensors["train"]
    steps_per_epoch = math.ceil(len(x_train) / hp.batch_size)
    total_steps = hp.epochs * steps_per_epoch

    torch.manual_seed(hp.seed)
    net = mlp.build_model(hp.model_config).to(ranks.device)
    optimizer = make_optimizer(net.parameters(), hp)
    seed_rank_rng(hp.seed, ranks, 0)
    pos = resume(root, net, optimizer, hp, ranks) or Position()
    start_step = pos.step
    # DDP broadcasts rank 0's weights at construction; the optimizer keeps working on the
    # same parameter tensors, so it needn't be rebuilt.
    model: nn.Module = net
    if ranks.distributed:
        device_ids = [ranks.device] if ranks.device.type == "cuda" else None
        model = DistributedDataParallel(net, device_ids=device_ids)
    tracker = Tracker(hp, ranks)

    def report(metrics: dict[str, float]) -> None:
        if progress_file is not None and ranks.is_main:
            progress = {"step": pos.step, "total_steps": total_steps, "epoch": pos.epoch, "metrics": metrics}
            write_json_atomically(progress_file, progress)

    report({})
    log(
        ranks,
        f"training {hp.epochs} epochs, {total_steps} steps, "
        f"world size {ranks.world_size}, device {ranks.device}",
    )
    started = time.monotonic()
    try:
        model.train()
        while pos.epoch < hp.epochs:
            order = epoch_order(hp.seed, pos.epoch, len(x_train))
            loss_sum = torch.zeros(2, device=ranks.device)  # (sum of batch losses, batches)
            while pos.batch < steps_per_epoch:
                rows = torch.from_numpy(rank_batch(order, pos.batch, hp.batch_size, ranks)).to(ranks.device)
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x_train[rows]), y_train[rows])
                loss.backward()
                optimizer.step()
                loss_sum += torch.stack([loss.detach(), torch.ones((), device=ranks.device)])
                pos.step += 1
                pos.batch += 1
                preempted = any_rank(stop.requested, ranks)
                if preempted or pos.step % every == 0:
                    save_checkpoint(root, net, optimizer, hp, pos, ranks)
                if preempted:
                    if ranks.is_main:
                        (root / contract.PREEMPTED_MARKER).write_text(f"{pos.step}\n")
                    log(ranks, f"preempted: saved checkpoint at step {pos.step}/{total_steps}")
                    tracker.end("KILLED")
                    return contract.EXIT_PREEMPTED

            if ranks.distributed:
                dist.all_reduce(loss_sum)
            pos.epoch, pos.batch = pos.epoch + 1, 0
            if ranks.is_main:
                val_loss, val_accuracy = evaluate(net, *tensors["val"])
                metrics = {"val_loss": val_loss, "val_accuracy": val_accuracy}
                # A job resumed at the very end of an epoch trained no batch of it in this run.
                if loss_sum[1] > 0:
                    metrics["train_loss"] = (loss_sum[0] / loss_sum[1]).item()
                tracker.log_metrics(metrics, step=pos.step)
                report(metrics)
                log(
                    ranks,
                    f"epoch {pos.epoch}/{hp.epochs} step {pos.step}/{total_steps} "
                    + " ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())),
                )

        if ranks.is_main:
            val_loss, val_accuracy = evaluate(net, *tensors["val"])
            _, test_accuracy = evaluate(net, *tensors["test"])
            final = {
                "val_accuracy": val_accuracy,
                "val_loss": val_loss,
                "test_accuracy": test_accuracy,
                "step": pos.step,
                "epochs": hp.epochs,
            }
            save_mlflow_model(root / contract.FINAL_DIRNAME, net, tensors["val"][0][:2].cpu().numpy())
            # val_accuracy at this step is already the last epoch's value.
            tracker.log_metrics({"test_accuracy": test_accuracy}, step=pos.step)
            report(final)
        log(
            ranks,
            f"finished: step {pos.step}/{total_steps}, trained {pos.step - start_step} steps in this run "
            f"({time.monotonic() - started:.1f}s)",
        )
        tracker.end("FINISHED")
        return contract.EXIT_OK
    except BaseException:
        tracker.end("FAILED")
        raise


def main() -> int:
    stop = StopFlag()
    stop.install()
    try:
        hp = HParams.from_json(os.environ.get(contract.HPARAMS, ""))
    except UsageError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    ranks = setup_ranks()
    try:
        code = train(hp, ranks, stop)
        if ranks.distributed:
            # Wait for rank 0 to finish writing: torchrun stops the other ranks as soon
            # as one exits with a non-zero code, and a rank tearing down its process
            # group while a peer still uses it can abort.
            dist.barrier()
        return code
    except UsageError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    finally:
        if ranks.distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
