"""Where the served model runs (``MODEL_DEVICE``): the setting parsed and resolved, and an MLflow model loaded there.

``MODEL_DEVICE`` is ``auto`` (the default), ``cpu``, ``cuda`` or ``cuda:N``. ``auto`` is ``cuda`` when torch is
importable, ``CUDA_VISIBLE_DEVICES`` is not empty and ``torch.cuda.is_available()``, else ``cpu``; gpuferry's
serving backends always set it explicitly (a service given GPUs gets ``cuda``, one without gets ``cpu`` and
``CUDA_VISIBLE_DEVICES=""``). ``cuda`` means the first visible GPU (``cuda:0``).

What the setting does depends on the model's flavour:

- ``mlflow.pytorch``: the server loads the model itself, where the setting says, and hands it to MLflow's own
  pyfunc wrapper (``mlflow.pytorch._PyTorchWrapper``, which moves each batch to that device and the answers
  back), as ``mlflow.pyfunc.load_model(path, model_config={"device": ...})`` would, with two differences.
  A ``torch.export`` model (``model.pt2``, MLflow 3's default) whose weights were saved on another device is
  moved with ``torch.export.passes.move_to_device_pass`` (MLflow refuses it: "it can't be loaded on 'cuda'
  device"); a pickled (``serialization_format="pickle"``) or TorchScript model is loaded with
  ``map_location=<device>`` (MLflow loads it where it was saved, then moves it). A ``torch.export`` model
  saved on a GPU is refused by a CPU service (its weights load only onto the device they were saved on):
  save it from the CPU (``model.cpu()`` before ``save_model``), which serves on either.
- A model whose MLmodel declares a ``device`` key in its pyfunc ``config`` (a ``PythonModel`` logged with
  ``model_config={"device": ...}``) gets the resolved device through ``model_config``, as MLflow passes it.
- Any other flavour (scikit-learn, transformers, ...) loads as ``mlflow.pyfunc.load_model`` loads it: the
  server cannot place it. The device reported is the one the model says it runs on (a transformers
  pipeline's ``device``), else ``cpu``; a service that asked for a GPU logs a warning that the model does not use it.

The ``cpu`` path never calls into ``torch.cuda``: a CPU service on a GPU node takes no GPU memory.

What MLflow 3.17's own ``model_config={"device": ...}`` does, read in its source: ``mlflow.pytorch`` honours it
(else ``MLFLOW_DEFAULT_PREDICTION_DEVICE``, else ``cuda`` whenever torch sees a GPU), but loads a pickled model
where it was saved and then moves it, and refuses a ``torch.export`` model saved on another device;
``mlflow.transformers`` ignores it (its ``model_config`` is the pipeline's inference config; the pipeline goes to
``MLFLOW_DEFAULT_PREDICTION_DEVICE``, an integer, else GPU 0 whenever one is visible); flavours whose MLmodel
declares no such key (``mlflow.sklearn``, ...) drop it with a warning. ``MLFLOW_DEFAULT_PREDICTION_DEVICE`` is
not read for torch models here: ``MODEL_DEVICE`` decides.

A moved ``torch.export`` program has its ``view`` ops made ``reshape`` (``reshape_views``): the kernels of the
other device may lay tensors out in strides no view takes. The server's warm-up (the model's own serving input
example) then runs on the device: a moved model that still fails there fails the start with the same advice.

A model that cannot go where the service asks (``cuda`` and torch sees no GPU, a move that fails) raises
``DeviceError`` naming the model, the device and what to do; the server then fails without becoming ready.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import contract

log = logging.getLogger("runtime.serve")

AUTO, CPU, CUDA = "auto", "cpu", "cuda"
CHOICES = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(?::(\d+))?")
_PT2_PAYLOAD_CONFIG = re.compile(r"(?:^|/)data/(?:weights|constants)/[^/]+_config\.json$")
_NO_GPU_FIX = f"give the service a GPU, or set {contract.MODEL_DEVICE}=cpu to serve it on the CPU"


class DeviceError(RuntimeError):
    """The model cannot run on the device the service asks for; the message says what to do."""


def parse_device(raw: str) -> str:
    """``MODEL_DEVICE``'s value, checked and normalised (``auto`` when empty); ``ValueError`` when it is none."""
    value = raw.strip().lower() or AUTO
    match = _DEVICE.fullmatch(value)
    if match is None:
        raise ValueError(f"{contract.MODEL_DEVICE}={raw!r} is not a device: use {CHOICES}")
    return f"{CUDA}:{int(match.group(1))}" if match.group(1) is not None else value


def gpus_hidden() -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` is set and empty (the service was given no GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and not visible.strip()


def resolve(requested: str) -> str:
    """``auto`` made ``cuda`` or ``cpu``; other values as they are. Calls ``torch.cuda`` only for ``auto`` with
    GPUs not hidden."""
    if requested != AUTO:
        return requested
    if gpus_hidden():
        return CPU
    try:
        import torch
    except ImportError:
        return CPU
    return CUDA if torch.cuda.is_available() else CPU


def cuda_device(device: str, name: str) -> str:
    """``cuda`` or ``cuda:N`` as ``cuda:N``, once torch is known to see that GPU; ``DeviceError`` otherwise."""
    index = int(device.partition(":")[2] or 0)
    try:
        import torch
    except ImportError:
        raise DeviceError(f"the model {name!r} cannot run on {device}: torch is not installed; {_NO_GPU_FIX}") from None
    if gpus_hidden():
        why = "CUDA_VISIBLE_DEVICES is empty (the service was given no GPU)"
    elif not torch.cuda.is_available():
        build = "" if torch.version.cuda else f" (this torch, {torch.__version__}, is built without CUDA)"
        why = f"torch sees no GPU{build}"
    elif index >= (count := torch.cuda.device_count()):
        why = f"torch sees {count} GPU{'s' if count != 1 else ''}"
    else:
        return f"{CUDA}:{index}"
    raise DeviceError(f"the model {name!r} cannot run on {device}: {why}; {_NO_GPU_FIX}")


@dataclass(frozen=True)
class Placed:
    """A loaded pyfunc model and where it runs."""

    model: Any  # mlflow.pyfunc.PyFuncModel
    device: str  # "cpu", "cuda:0", ...
    how: str  # how it got there, for the start-up log


def load_pyfunc(path: Path, meta: Any, requested: str, name: str) -> Placed:
    """The MLflow model at ``path`` (its ``MLmodel`` read as ``meta``) loaded on the device ``requested``
    (``MODEL_DEVICE``) resolves to, as the module docstring says; ``DeviceError`` when it cannot go there."""
    import mlflow.pyfunc

    conf = meta.flavors.get("python_function") or {}
    if conf.get("loader_module") == "mlflow.pytorch":
        return _load_torch(path, meta, conf, requested, name)
    declared = conf.get("config")
    if isinstance(declared, dict) and "device" in declared:
        device = resolve(requested)
        if device != CPU:
            device = cuda_device(device, name)
        model = mlflow.pyfunc.load_model(str(path), model_config={"device": device})
        return Placed(model, device, f"{conf.get('loader_module')}, model_config device {device}")
    model = mlflow.pyfunc.load_model(str(path))
    device = _reported_device(model)
    if requested not in (AUTO, CPU) and device == CPU:
        log.warning(
            "%s=%s, but the model %r (%s) runs where its flavour puts it, on the CPU: the GPU is not used",
            contract.MODEL_DEVICE,
            requested,
            name,
            conf.get("loader_module"),
        )
    return Placed(model, device, f"{conf.get('loader_module')}, placed by its flavour")


def _reported_device(model: Any) -> str:
    """Where a model the server did not place runs: the raw model's ``device`` (a transformers pipeline's), else cpu."""
    try:
        device = getattr(model.get_raw_model(), "device", None)
    except Exception:  # noqa: BLE001 - most flavours have no raw model or no device
        return CPU
    return str(device) if device is not None and type(device).__name__ == "device" else CPU


# ------------------------------------------------------------------------------------------- torch models


def _load_torch(path: Path, meta: Any, conf: dict[str, Any], requested: str, name: str) -> Placed:
    """What ``mlflow.pyfunc.load_model`` does for ``mlflow.pytorch``, with the model put on the device first."""
    from mlflow.pyfunc import PyFuncModel
    from mlflow.pytorch import _PyTorchWrapper
    from mlflow.utils.model_utils import _add_code_from_conf_to_system_path

    device = resolve(requested)
    if device != CPU:
        device = cuda_device(device, name)
    _add_code_from_conf_to_system_path(str(path), conf, code_key="code")
    data = path / conf["data"] if conf.get("data") else path
    if (data / "model.pth").is_file():
        module = load_pickled(data, device, name)
        how = f"{'TorchScript' if _is_script(module) else 'pickled'}, map_location={device}"
    else:
        module, how = load_exported(data / "model.pt2", device, name)
    if isinstance(conf.get("config"), dict) and "device" in conf["config"]:
        conf["config"]["device"] = device  # what MLflow's load_model leaves there: PyFuncModel.model_config says it
    model = PyFuncModel(
        model_meta=meta,
        model_impl=_PyTorchWrapper(module, device=device),
        predict_fn=conf.get("predict_fn", "predict"),
        model_id=getattr(meta, "model_id", None),
    )
    try:
        model.input_example = meta.load_input_example(path=str(path))
    except Exception:
        log.debug("no input example loaded", exc_info=True)
    return Placed(model, module_device(module, device), f"mlflow.pytorch, {how}")


def _is_script(module: Any) -> bool:
    import torch

    return isinstance(module, torch.jit.ScriptModule)


def load_pickled(data: Path, device: str, name: str) -> Any:
    """A pickled or TorchScript model (``data/model.pth``) loaded straight onto ``device`` (``map_location``),
    through MLflow's own loader (its pickle module and its pickle-deserialisation check)."""
    from mlflow.exceptions import MlflowException
    from mlflow.pytorch import _load_model

    try:
        return _load_model(str(data), device=device, weights_only=False, map_location=device)
    except MlflowException:
        raise  # MLflow's own refusals (pickle deserialisation disallowed, ...) say what to do
    except Exception as exc:
        if device == CPU:
            raise
        raise DeviceError(
            f"the model {name!r} (a pickled torch model) could not be loaded onto {device}: "
            f"{type(exc).__name__}: {exc}; {_NO_GPU_FIX}"
        ) from exc


def load_exported(model_path: Path, device: str, name: str) -> tuple[Any, str]:
    """A ``torch.export`` model (``model.pt2``) as a module on ``device``: loaded where it was saved and, when
    that is another device, moved with ``move_to_device_pass``. MLflow's check that the archive is free of
    pickles runs first, as MLflow runs it."""
    import mlflow.pytorch
    import torch

    if not _pickle_allowed():
        mlflow.pytorch._validate_pt2_archive_is_pickle_free(str(model_path))
    saved = archive_devices(model_path)
    if device == CPU and any(d != CPU for d in saved):
        # Loading would put the weights on the GPU first: a CPU service must not touch it.
        raise DeviceError(
            f"the model {name!r} was saved with torch.export on {', '.join(sorted(saved))}, and its weights load "
            f"only there, but this service runs it on the CPU ({contract.MODEL_DEVICE}=cpu): save it from the "
            f"CPU (model.cpu() before mlflow.pytorch.save_model; it then serves on either), or with "
            f"mlflow.pytorch.save_model(..., serialization_format='pickle'), or give the service a GPU"
        )
    try:
        program = torch.export.load(str(model_path))
    except Exception as exc:
        if not saved or saved == {device}:
            raise
        raise DeviceError(
            f"the model {name!r} was saved with torch.export on {', '.join(sorted(saved))} and could not be "
            f"loaded there to move it to {device}: {type(exc).__name__}: {exc}; {_save_fix(device)}"
        ) from exc
    on = program_devices(program)
    if on == {device}:
        return program.module(), "torch.export"
    module = move_program(program, device, name, on).module()
    reshaped = reshape_views(module)
    return module, (
        f"torch.export, moved from {', '.join(sorted(on)) or 'no weights'} to {device}"
        + (f", {reshaped} view(s) as reshape" if reshaped else "")
    )


def reshape_views(module: Any) -> int:
    """A program exported on one device keeps the ``view`` ops that fitted the strides that device's kernels gave.
    On another device a kernel may give other strides (attention on CUDA: measured on an H200 with a transformer
    encoder exported on the CPU), and no view can take the tensor ("view size is not compatible with input
    tensor's size and stride"). Each ``aten.view`` whose result is not written in place becomes ``aten.reshape``:
    the same view wherever a view is possible, a copy where it is not. The number changed."""
    import torch

    view, reshape = torch.ops.aten.view.default, torch.ops.aten.reshape.default
    changed = 0
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is view and not _written_in_place(node, view):
            node.target = reshape
            changed += 1
    if changed:
        module.graph.lint()
        module.recompile()
    return changed


def _written_in_place(node: Any, view: Any) -> bool:
    """Whether an op that mutates its input reads ``node`` or a view of it (the copy would hide the write)."""
    pending, seen = list(node.users), set()
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        schema = getattr(user.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
        if user.target is view:
            pending.extend(user.users)
    return False


def _pickle_allowed() -> bool:
    """MLflow's own answer to whether pickled model files may be loaded (``MLFLOW_ALLOW_PICKLE_DESERIALIZATION``):
    its helper's name differs between MLflow versions (3.17: ``_is_pickle_deserialization_allowed``, 3.18:
    ``_is_pickle_loading_allowed``), and an image may bring either."""
    import mlflow.pytorch

    for name in ("_is_pickle_loading_allowed", "_is_pickle_deserialization_allowed"):
        helper = getattr(mlflow.pytorch, name, None)
        if callable(helper):
            return bool(helper())
    return os.environ.get("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "").strip().lower() in ("true", "1")


def move_program(program: Any, device: str, name: str, on: set[str]) -> Any:
    """``torch.export.passes.move_to_device_pass(program, device)``; ``DeviceError`` naming the fix when it fails."""
    try:
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(program, device)
    except Exception as exc:
        raise DeviceError(
            f"the model {name!r} (saved with torch.export on {', '.join(sorted(on)) or 'no weights'}) could not "
            f"be moved to {device}: {type(exc).__name__}: {exc}; {_save_fix(device)}"
        ) from exc


def moved_fix(how: str, device: str) -> str:
    """What to do when a model moved to ``device`` (``how`` says it was: ``Placed.how``) fails there; '' else."""
    return f"; it was moved to {device} from where it was exported: {_save_fix(device)}" if "moved from" in how else ""


def _save_fix(device: str) -> str:
    other = f"{contract.MODEL_DEVICE}=cpu (no GPU)" if device != CPU else "a GPU"
    return (
        f"save it with mlflow.pytorch.save_model(..., serialization_format='pickle') (served with "
        f"MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true), or save it from {device}, or serve it with {other}"
    )


def program_devices(program: Any) -> set[str]:
    """The devices of an exported program's weights and tensor constants (``cpu``, ``cuda:0``, ...)."""
    import torch

    tensors = [*program.state_dict.values(), *program.constants.values()]
    return {str(t.device) for t in tensors if isinstance(t, torch.Tensor)}


def archive_devices(model_path: Path) -> set[str]:
    """The devices a ``.pt2`` archive's weights and constants were saved on, read from its payload configs
    without loading anything; empty when the archive does not say (an older layout)."""
    found: set[str] = set()
    try:
        with zipfile.ZipFile(model_path) as archive:
            for entry in archive.namelist():
                if _PT2_PAYLOAD_CONFIG.search(entry):
                    for payload in json.loads(archive.read(entry)).get("config", {}).values():
                        where = (payload.get("tensor_meta") or {}).get("device") or {}
                        if where.get("type"):
                            index = where.get("index")
                            found.add(where["type"] if index is None else f"{where['type']}:{index}")
    except (OSError, zipfile.BadZipFile, ValueError, AttributeError, TypeError):
        return set()
    return found


def module_device(module: Any, default: str) -> str:
    """The device of a module's first parameter or buffer (``default`` when it has none)."""
    for tensors in (module.parameters(), module.buffers()):
        for tensor in tensors:
            return str(tensor.device)
    return default
