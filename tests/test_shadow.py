"""Shadow traffic (runtime/shadow.py): two real servers, the version serving copying a share of its requests to a
candidate that answers differently on every third row; clients only ever get the serving version's answers."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.shadow import ShadowSettings, agree, compare
from tests.pyfunc_models import save_pyfunc
from tests.test_serve import Server, _free_port, start, wait_for

# y = x, except that the candidate doubles every row whose x is a multiple of 3.
MODEL = """
import mlflow
import numpy as np


class Model(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        x = model_input["x"].to_numpy()
        return np.where((x % 3 == 0) & {candidate}, 2 * x, x)


mlflow.models.set_model(Model())
"""


@dataclass
class Pair:
    serving: Server  # copies to the candidate
    candidate: Server


PROBE = {"dataframe_records": [{"x": 1.0}]}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("shadow-models")
    return (
        save_pyfunc(root, "serving", MODEL.format(candidate=False)),
        save_pyfunc(root, "candidate", MODEL.format(candidate=True)),
    )


def pair(models: tuple[Path, Path], logs: Path, share: float) -> Pair:
    candidate = start(models[1], logs / "candidate.log", PROBE, DRAIN_SECONDS=0)
    url = f"{candidate.url}/invocations"
    serving = start(models[0], logs / "serving.log", PROBE, DRAIN_SECONDS=0, SHADOW_URL=url, SHADOW_SHARE=share)
    return Pair(serving, candidate)


@pytest.fixture
def half(models: tuple[Path, Path], tmp_path: Path) -> Iterator[Pair]:
    p = pair(models, tmp_path, share=0.5)
    try:
        # A startup probe answered 200 (the server became ready between its /readyz and its POST) was offered to
        # the shadow: one more request brings the copies back in step (every second request from the next on).
        if p.serving.metrics().get('inference_requests_total{code="200"}', 0.0) % 2 == 1:
            p.serving.post(PROBE)
        answered = p.serving.metrics().get('inference_requests_total{code="200"}', 0.0)
        wait_for(lambda: copies(p.serving) == answered // 2, "the startup probes' copies")
        yield p
    finally:
        codes = {"serving": p.serving.terminate(), "candidate": p.candidate.terminate()}
        assert codes == {"serving": 0, "candidate": 0}, p.serving.log()[-3000:] + p.candidate.log()[-3000:]


def shadow_counts(server: Server) -> dict[str, float]:
    return {k: v for k, v in server.metrics().items() if k.startswith("inference_shadow_")}


def copies(server: Server) -> float:
    return shadow_counts(server).get('inference_shadow_requests_total{code="200"}', 0.0)


def test_a_share_of_the_requests_is_copied_and_the_rows_compared_but_clients_get_the_serving_answers(
    half: Pair,
) -> None:
    def since() -> dict[str, float]:
        return {k: v - before.get(k, 0.0) for k, v in shadow_counts(half.serving).items()}

    before = shadow_counts(half.serving)  # the startup probes' (x = 1: they agree), if any were answered
    received = half.candidate.metrics().get('inference_requests_total{code="200"}', 0.0)
    answers = [half.serving.post({"dataframe_records": [{"x": float(x)}]}) for x in range(1, 31)]
    assert [a.status_code for a in answers] == [200] * 30
    assert [a.json()["predictions"] for a in answers] == [[float(x)] for x in range(1, 31)]  # never the candidate's
    # Every second request copied (share 0.5): 15 copies, x = 2, 4, ..., 30; of those, 6, 12, 18, 24, 30 disagree.
    wait_for(lambda: since().get('inference_shadow_requests_total{code="200"}') == 15, "copies")
    counts = since()
    assert counts['inference_shadow_rows_total{result="agree"}'] == 10
    assert counts['inference_shadow_rows_total{result="disagree"}'] == 5
    assert counts["inference_shadow_skipped_total"] == 0
    assert counts["inference_shadow_request_duration_seconds_count"] == 15
    # The candidate's own metrics count what it received: the copies.
    assert half.candidate.metrics()['inference_requests_total{code="200"}'] - received == 15
    # A batch, compared row by row: the 31st request is not copied, the 32nd (the batch) is.
    assert half.serving.post(PROBE).json()["predictions"] == [1.0]
    batch = half.serving.post({"dataframe_records": [{"x": 3.0}, {"x": 4.0}, {"x": 9.0}]})
    assert batch.json()["predictions"] == [3.0, 4.0, 9.0]
    wait_for(lambda: since()['inference_shadow_requests_total{code="200"}'] == 16, "the copy")
    counts = since()
    assert counts['inference_shadow_rows_total{result="agree"}'] == 11  # and x=4
    assert counts['inference_shadow_rows_total{result="disagree"}'] == 7  # and x=3, x=9


def test_a_shadow_that_does_not_answer_changes_no_answer(models: tuple[Path, Path], tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{_free_port()}/invocations"  # nothing listens there
    serving = start(models[0], tmp_path / "serving.log", PROBE, DRAIN_SECONDS=0, SHADOW_URL=dead, SHADOW_TIMEOUT_S=2)
    try:
        answers = [serving.post({"dataframe_records": [{"x": float(x)}]}) for x in range(1, 6)]
        assert [a.json()["predictions"] for a in answers] == [[float(x)] for x in range(1, 6)]
        wait_for(lambda: shadow_counts(serving).get('inference_shadow_requests_total{code="none"}') == 5, "the copies")
        counts = shadow_counts(serving)
        assert counts['inference_shadow_rows_total{result="agree"}'] == 0
        assert counts['inference_shadow_rows_total{result="disagree"}'] == 0  # nothing to compare with
    finally:
        assert serving.terminate() == 0, serving.log()[-3000:]


def test_answers_agree_by_value_within_the_tolerances() -> None:
    assert agree({"a": [1, 2.0, "cat", None, True]}, {"a": [1.0, 2.0000001, "cat", None, True]}, 1e-6, 0)
    assert not agree("cat", "dog", 1, 1) and not agree(True, 1, 1, 1) and not agree(None, 0, 1, 1)
    assert not agree(1.0, 1.1, 1e-6, 0) and agree(1.0, 1.1, 0.1, 0) and agree(0.0, 1e-9, 0, 1e-8)
    assert agree(math.nan, math.nan, 0, 0) and not agree(math.nan, 1.0, 1, 1)
    assert not agree([1, 2], [1, 2, 3], 1, 1) and not agree({"a": 1}, {"b": 1}, 1, 1)
    assert compare(b'{"predictions": [1, 2, 3]}', b'{"predictions": [1, 5, 3]}', 0, 0) == (2, 1)
    assert compare(b'{"predictions": [1, 2]}', b'{"predictions": [1]}', 0, 0) == (0, 1)  # not row by row
    assert compare(b'{"predictions": {"a": [1]}}', b'{"predictions": {"a": [1]}}', 0, 0) == (1, 0)
    assert compare(b"1,2\n", b"not json", 0, 0) == (0, 1)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"SHADOW_URL": "https://x/invocations"}, "SHADOW_URL='https://x/invocations' must be an http URL"),
        ({"SHADOW_URL": "http://x:8080/invocations", "SHADOW_SHARE": "0"}, "SHADOW_SHARE='0' must be above 0"),
        ({"SHADOW_URL": "http://x:8080/invocations", "SHADOW_SHARE": "1.5"}, "SHADOW_SHARE='1.5' must be above 0"),
        ({"SHADOW_URL": "http://x:8080/invocations", "SHADOW_RTOL": "a"}, "SHADOW_RTOL='a' is not a number"),
        ({"SHADOW_URL": "http://x:8080/invocations", "SHADOW_MAX_INFLIGHT": "0"}, "SHADOW_MAX_INFLIGHT='0' must be"),
    ],
)
def test_bad_shadow_settings_name_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ValueError) as raised:
        ShadowSettings.from_env(env)
    assert fragment in str(raised.value)


def test_no_shadow_url_no_shadow() -> None:
    assert ShadowSettings.from_env({"SHADOW_SHARE": "0.5"}) is None
    settings = ShadowSettings.from_env({"SHADOW_URL": "http://model-v2:8080/invocations", "SHADOW_SHARE": "0.1"})
    assert settings is not None and settings.share == 0.1 and settings.max_inflight == 8
