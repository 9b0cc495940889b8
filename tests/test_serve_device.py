"""MODEL_DEVICE: where runtime/serve.py runs the model (runtime/device.py), checked without a GPU.

The models are torch MLPs saved as ``mlflow.pytorch.save_model`` saves them by default (``torch.export``, a
``model.pt2``), pickled (``serialization_format="pickle"``) and as TorchScript, plus a scikit-learn model and a
``PythonModel`` that declares a ``device`` in its model config. Each is loaded through the server's own path and
its answers compared with ``mlflow.pyfunc.load_model(dir).predict``. The move of a ``torch.export`` program
between devices runs for real with the CPU as the target (``move_to_device_pass(program, "cpu")``); what needs a
GPU (the move to ``cuda``) is ``bench/gpu_check.py``'s. The server is started as a process where what matters is
what it says: ``/readyz``, ``/version``, its log, its exit code.
"""

from __future__ import annotations

import io
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from runtime import contract
from runtime.device import (
    DeviceError,
    archive_devices,
    cuda_device,
    load_pyfunc,
    move_program,
    parse_device,
    program_devices,
    resolve,
)
from runtime.manifest import HashCache, write_manifest
from runtime.settings import Settings
from tests.test_serve import _run_to_exit, follow_until_ready, launch

PICKLE_ALLOWED = {"MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "true"}  # MLflow 3.17 refuses pickled models otherwise

PYFUNC_WITH_DEVICE = """
import mlflow
import numpy as np


class Where(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        self.device = context.model_config["device"]

    def predict(self, context, model_input, params=None):
        return np.array([self.device] * len(model_input))


mlflow.models.set_model(Where())
"""


@dataclass(frozen=True)
class Models:
    exported: Path  # the default: torch.export (model.pt2)
    pickled: Path
    scripted: Path  # TorchScript, saved by MLflow with serialization_format="pickle"
    sklearn: Path
    pyfunc: Path  # a PythonModel whose model_config declares "device"
    x: np.ndarray


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    import mlflow.pyfunc
    import mlflow.pytorch
    import mlflow.sklearn
    import pandas as pd
    import torch
    from sklearn.linear_model import LogisticRegression

    root = tmp_path_factory.mktemp("device-models")
    rng = np.random.default_rng(0)
    x = rng.random((16, 8), dtype=np.float32)
    torch.manual_seed(0)
    # A BatchNorm (buffers as well as parameters), in eval mode as a trained model is saved.
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 3),
        torch.nn.Softmax(dim=1),
    ).eval()
    example = x[:2]  # two rows: a batch dimension of 1 would be exported as static
    common = {"input_example": example, "pip_requirements": ["torch"]}
    mlflow.pytorch.save_model(net, root / "exported", **common)
    mlflow.pytorch.save_model(net, root / "pickled", serialization_format="pickle", **common)
    mlflow.pytorch.save_model(torch.jit.script(net), root / "scripted", serialization_format="pickle", **common)
    classifier = LogisticRegression().fit(x, np.arange(len(x)) % 2)
    mlflow.sklearn.save_model(classifier, root / "sklearn", input_example=x[:2], pip_requirements=["scikit-learn"])
    code = root / "where_model.py"
    code.write_text(PYFUNC_WITH_DEVICE)
    mlflow.pyfunc.save_model(
        root / "pyfunc",
        python_model=str(code),
        input_example=pd.DataFrame({"a": [1.0, 2.0]}),
        model_config={"device": None},
        pip_requirements=["mlflow"],
    )
    hashes = HashCache(root / "hashes")
    for name in ("exported", "pickled", "scripted", "sklearn", "pyfunc"):
        write_manifest(root / name, hashes)
    return Models(root / "exported", root / "pickled", root / "scripted", root / "sklearn", root / "pyfunc", x)


def expected(model_dir: Path, x: Any) -> np.ndarray:
    import mlflow.pyfunc

    return np.asarray(mlflow.pyfunc.load_model(str(model_dir)).predict(x))


def place(model_dir: Path, requested: str, name: str = "test-model") -> Any:
    from mlflow.models import Model

    return load_pyfunc(model_dir, Model.load(str(model_dir)), requested, name)


def _forbid(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    import torch

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the cpu path called into torch.cuda")

    for name in names:
        monkeypatch.setattr(torch.cuda, name, forbidden)


@pytest.fixture
def no_cuda_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """Initialising CUDA (a context on a GPU: memory taken) fails the test. Everything in torch.cuda that needs a
    context goes through ``_lazy_init``; ``is_available`` does not (torch's own fake tensors ask it when
    ``torch.export.load`` reads a program)."""
    _forbid(monkeypatch, "init", "_lazy_init")


# ---------------------------------------------------------------------------------------------- the setting


def test_model_device_is_parsed_with_a_clear_error_for_a_bad_value() -> None:
    base = {contract.MODEL_URI: "/m"}
    assert Settings.from_env(base).model_device == "auto"
    for raw, value in [
        ("", "auto"),
        ("auto", "auto"),
        ("cpu", "cpu"),
        (" CUDA ", "cuda"),
        ("cuda:1", "cuda:1"),
        ("cuda:01", "cuda:1"),
    ]:
        assert Settings.from_env({**base, contract.MODEL_DEVICE: raw}).model_device == value, raw
    for raw in ("gpu", "cuda:", "cuda:-1", "cuda:x", "mps", "cuda0", "cpu:0"):
        with pytest.raises(ValueError, match=f"MODEL_DEVICE={raw!r} is not a device: use auto, cpu, cuda or cuda:N"):
            parse_device(raw)
    proc = _run_to_exit("/nowhere", {contract.MODEL_DEVICE: "gpu"})
    assert proc.returncode == 2 and "MODEL_DEVICE='gpu' is not a device" in proc.stderr, proc.stderr


def test_auto_is_cuda_only_when_torch_sees_a_gpu_and_none_is_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert resolve("auto") == ("cuda" if torch.cuda.is_available() else "cpu")  # this machine: no GPU, cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve("auto") == "cuda"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert resolve("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve("auto") == "cpu"
    assert resolve("cpu") == "cpu" and resolve("cuda:1") == "cuda:1"  # explicit values as they are


def test_hidden_gpus_make_auto_cpu_without_asking_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid(monkeypatch, "is_available", "device_count", "init", "_lazy_init")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert resolve("auto") == "cpu"
    assert resolve("cpu") == "cpu"


def test_cuda_is_checked_against_what_torch_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        DeviceError,
        match=r"the model 'm' cannot run on cuda: torch sees no GPU.*; give the service a "
        r"GPU, or set MODEL_DEVICE=cpu to serve it on the CPU",
    ):
        cuda_device("cuda", "m")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_device("cuda", "m") == "cuda:0"
    assert cuda_device("cuda:0", "m") == "cuda:0"
    with pytest.raises(DeviceError, match="the model 'm' cannot run on cuda:1: torch sees 1 GPU;"):
        cuda_device("cuda:1", "m")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError, match="cannot run on cuda: CUDA_VISIBLE_DEVICES is empty"):
        cuda_device("cuda", "m")


# ----------------------------------------------------------------------------------------- loading in place


def test_an_exported_model_loads_on_the_cpu_as_mlflow_loads_it(models: Models, no_cuda_init: None) -> None:
    import torch
    from mlflow.pyfunc import PyFuncModel
    from mlflow.pytorch import _PyTorchWrapper

    from runtime.direct import DirectPredict

    placed = place(models.exported, "cpu")
    assert placed.device == "cpu" and placed.how == "mlflow.pytorch, torch.export"
    assert isinstance(placed.model, PyFuncModel) and isinstance(placed.model._model_impl, _PyTorchWrapper)
    assert placed.model.model_config == {"device": "cpu"} and placed.model.loader_module == "mlflow.pytorch"
    np.testing.assert_array_equal(placed.model.predict(models.x), expected(models.exported, models.x))
    direct = DirectPredict.of(placed.model)  # the scorer's fast path works on the model as placed
    assert direct is not None
    np.testing.assert_array_equal(direct(models.x, None), expected(models.exported, models.x))
    assert not torch.cuda.is_initialized()


def test_an_exported_model_saved_elsewhere_is_moved_with_the_move_pass(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The program reads as saved on a GPU, so the loader moves it to the CPU with move_to_device_pass (for real)."""
    import torch
    import torch.export.passes

    import runtime.device

    moves: list[str] = []
    real_move = torch.export.passes.move_to_device_pass

    def move(program: Any, location: str) -> Any:
        moves.append(location)
        return real_move(program, location)

    monkeypatch.setattr(torch.export.passes, "move_to_device_pass", move)
    monkeypatch.setattr(runtime.device, "program_devices", lambda program: {"cuda:0"})
    placed = place(models.exported, "cpu")
    assert moves == ["cpu"] and placed.device == "cpu"
    assert placed.how == "mlflow.pytorch, torch.export, moved from cuda:0 to cpu"
    np.testing.assert_array_equal(placed.model.predict(models.x), expected(models.exported, models.x))

    # The pass itself on a loaded program: every weight stays where it belongs, the answers do not change.
    program = torch.export.load(str(models.exported / "data" / "model.pt2"))
    assert program_devices(program) == {"cpu"}
    moved = move_program(program, "cpu", "test-model", {"cpu"})
    assert program_devices(moved) == {"cpu"}
    out = moved.module()(torch.from_numpy(models.x)).detach().numpy()
    np.testing.assert_allclose(out, expected(models.exported, models.x), rtol=0, atol=1e-6)


def test_a_move_that_fails_names_the_model_the_device_and_the_fix(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.export.passes

    import runtime.device

    def broken(program: Any, location: str) -> Any:
        raise RuntimeError("cannot move this op")

    monkeypatch.setattr(torch.export.passes, "move_to_device_pass", broken)
    monkeypatch.setattr(runtime.device, "program_devices", lambda program: {"cuda:0"})
    with pytest.raises(DeviceError) as refused:
        place(models.exported, "cpu", name="digits")
    message = str(refused.value)
    assert message.startswith("the model 'digits' (saved with torch.export on cuda:0) could not be moved to cpu: ")
    assert "RuntimeError: cannot move this op" in message
    assert "serialization_format='pickle'" in message and "MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true" in message


def test_an_exported_model_saved_on_a_gpu_is_refused_by_a_cpu_service_before_it_loads(
    models: Models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_cuda_init: None
) -> None:
    import shutil

    import torch

    gpu_saved = tmp_path / "gpu-saved"
    shutil.copytree(models.exported, gpu_saved)
    _claim_device(gpu_saved / "data" / "model.pt2", {"type": "cuda", "index": 0})
    assert archive_devices(gpu_saved / "data" / "model.pt2") == {"cuda:0"}
    assert archive_devices(models.exported / "data" / "model.pt2") == {"cpu"}

    def no_load(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch.export.load was called")

    monkeypatch.setattr(torch.export, "load", no_load)
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")  # the archive was edited: skip MLflow's check
    with pytest.raises(
        DeviceError,
        match=r"the model 'digits' was saved with torch.export on cuda:0.*MODEL_DEVICE=cpu"
        r".*model\.cpu\(\) before mlflow\.pytorch\.save_model.*serialization_format='pickle'",
    ):
        place(gpu_saved, "cpu", name="digits")


def _claim_device(archive: Path, device: dict[str, Any]) -> None:
    """Rewrite a .pt2 archive's weights config so that it says its weights were saved on ``device``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(buffer, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("_weights_config.json"):
                config = json.loads(data)
                for payload in config["config"].values():
                    payload["tensor_meta"]["device"] = device
                data = json.dumps(config).encode()
            target.writestr(info, data)
    archive.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("kind", ["pickled", "scripted"])
def test_pickled_and_torchscript_models_are_mapped_to_the_device(
    models: Models, kind: str, monkeypatch: pytest.MonkeyPatch, no_cuda_init: None
) -> None:
    import torch

    for name, value in PICKLE_ALLOWED.items():
        monkeypatch.setenv(name, value)
    model_dir = getattr(models, kind)
    locations: list[Any] = []
    real_load = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        locations.append(kwargs.get("map_location"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    placed = place(model_dir, "cpu")
    assert locations == ["cpu"] and placed.device == "cpu"
    assert placed.how == f"mlflow.pytorch, {'TorchScript' if kind == 'scripted' else 'pickled'}, map_location=cpu"
    monkeypatch.setattr(torch, "load", real_load)
    np.testing.assert_array_equal(placed.model.predict(models.x), expected(model_dir, models.x))


def test_other_flavours_load_as_mlflow_loads_them_and_say_so(
    models: Models, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import pandas as pd

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with caplog.at_level(logging.WARNING, logger="runtime.serve"):
        placed = place(models.sklearn, "cuda", name="clf")  # a GPU asked: fine, but it runs on the CPU
    assert placed.device == "cpu"
    assert (
        "MODEL_DEVICE=cuda, but the model 'clf' (mlflow.sklearn) runs where its flavour puts it, on the CPU"
        in caplog.text
    )
    np.testing.assert_array_equal(placed.model.predict(models.x), expected(models.sklearn, models.x))

    frame = pd.DataFrame({"a": [1.0, 2.0]})
    placed = place(models.pyfunc, "cpu")  # it declared a device in its model config: it is handed the device
    assert placed.device == "cpu" and list(placed.model.predict(frame)) == ["cpu", "cpu"]
    with pytest.raises(DeviceError, match="cannot run on cuda: CUDA_VISIBLE_DEVICES is empty"):
        place(models.pyfunc, "cuda")


# ------------------------------------------------------------------------------------------------ the server


def test_the_server_says_where_the_model_runs(models: Models, tmp_path: Path) -> None:
    body = {"inputs": models.x[:3].tolist()}
    srv = follow_until_ready(
        launch(
            models.exported,
            tmp_path / "serve.log",
            MODEL_DEVICE="cpu",
            MODEL_NAME="digits",
            DRAIN_SECONDS=0,
            WARMUP_ITERATIONS=1,
        ),
        body,
    )
    try:
        ready = httpx.get(f"{srv.url}/readyz", timeout=30).json()
        assert ready["device"] == "cpu" and ready["settings"]["model_device"] == "cpu"
        version = httpx.get(f"{srv.url}/version", timeout=30)
        assert version.headers["x-model-device"] == "cpu"
        assert version.text == _mlflow_version()  # the body stays what `mlflow models serve` answers
        answer = srv.post(body)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["predictions"], expected(models.exported, models.x[:3]), rtol=1e-6)
    finally:
        assert srv.terminate() == 0, srv.log()
    assert "model ready in" in srv.log() and "digits (mlflow.pytorch) on cpu" in srv.log()
    assert "the model 'digits' is on cpu (mlflow.pytorch, torch.export)" in srv.log()


def test_a_server_asked_for_a_gpu_it_does_not_have_never_becomes_ready(models: Models) -> None:
    proc = _run_to_exit(
        models.exported.as_uri(), {contract.MODEL_DEVICE: "cuda", "MODEL_NAME": "digits", "CUDA_VISIBLE_DEVICES": ""}
    )
    assert proc.returncode == 1, proc.stderr
    assert "model ready" not in proc.stderr and "could not load the model" in proc.stderr
    assert (
        "the model 'digits' cannot run on cuda: CUDA_VISIBLE_DEVICES is empty (the service was given no GPU); give the "
        "service a GPU, or set MODEL_DEVICE=cpu to serve it on the CPU"
    ) in proc.stderr
    assert "Traceback" not in proc.stderr  # the message says it all


def _mlflow_version() -> str:
    import mlflow

    return mlflow.__version__


def _graph(*, in_place: bool) -> torch.fx.GraphModule:
    """``x.permute(1, 0).view(-1)`` as an exported program records it (aten ops), optionally with an in-place add
    on the view: the view fits only the strides the exporting device's kernels gave."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    permuted = graph.call_function(torch.ops.aten.permute.default, (x, [1, 0]))
    flat = graph.call_function(torch.ops.aten.view.default, (permuted, [-1]))
    if in_place:
        graph.call_function(torch.ops.aten.add_.Tensor, (flat, 1.0))
    graph.output(flat)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_moved_programs_views_become_reshapes_unless_written_in_place() -> None:
    """What failed on an H200 (a transformer encoder exported on the CPU, served on cuda: attention gave strides
    its recorded view could not take), reproduced on the CPU with a view that does not fit the input's strides."""
    from runtime.device import reshape_views

    x = torch.arange(6.0).reshape(2, 3)
    module = _graph(in_place=False)
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        module(x)
    assert reshape_views(module) == 1
    assert torch.equal(module(x), x.permute(1, 0).reshape(-1))
    assert reshape_views(module) == 0  # nothing left to change

    written = _graph(in_place=True)
    assert reshape_views(written) == 0  # a copy would hide the write: left as it is
