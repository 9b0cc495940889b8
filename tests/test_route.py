"""A canary or shadow set while the server runs (runtime/route.py): two real servers, the version serving reading its
route file; the candidate answers differently on every multiple of 3, so each answer says who gave it."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.route import parse
from runtime.watched import WatchedFile, replace_file
from tests.test_serve import Server, _free_port, start, wait_for
from tests.test_shadow import PROBE, Pair, models  # noqa: F401 - a fixture: the serving and the candidate model


@pytest.fixture
def routed(models: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[Pair, Path]]:
    """The two servers; the serving one reads ``route.json`` (absent at first)."""
    route = tmp_path / "route.json"
    candidate = start(models[1], tmp_path / "candidate.log", PROBE, DRAIN_SECONDS=0)
    serving = start(models[0], tmp_path / "serving.log", PROBE, DRAIN_SECONDS=0, ROUTE_FILE=route)
    pair = Pair(serving, candidate)
    try:
        yield pair, route
    finally:
        codes = {"serving": serving.terminate(), "candidate": candidate.terminate()}
        assert codes == {"serving": 0, "candidate": 0}, serving.log()[-3000:] + candidate.log()[-3000:]


def test_a_watched_file_reports_each_change_once(tmp_path: Path) -> None:
    """What the front's target and shadow files and the server's route file are read again on: the file appearing,
    replaced by a rename (even with the same bytes: a ConfigMap volume's swap is one), and going."""
    path = tmp_path / "route.json"
    watched = WatchedFile(str(path))
    assert not watched.changed() and watched.read() is None  # no file yet: nothing changed
    replace_file(str(path), b'{"generation": 1}')
    assert watched.changed() and watched.read() == '{"generation": 1}'
    assert not watched.changed()
    replace_file(str(path), b'{"generation": 1}')  # the same bytes, a new file
    assert watched.changed() and not watched.changed()
    path.unlink()
    assert watched.changed() and watched.read() is None
    assert not watched.changed()


class Busy:
    """A stand-in version that answers every POST with 503 and Retry-After, as an overloaded server does."""

    def __init__(self) -> None:
        outer = self
        self.asked = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - the http.server name
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.asked += 1
                body = b'{"error_code": "TEMPORARILY_UNAVAILABLE", "message": "overloaded"}'
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Retry-After", "1")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def write(route: Path, content: dict[str, object]) -> None:
    """As the kubelet updates a ConfigMap key: the new file appears whole (a rename)."""
    route.with_suffix(".tmp").write_text(json.dumps(content))
    route.with_suffix(".tmp").rename(route)


def ok(server: Server) -> float:
    """The requests the server answered 200 so far (its readiness probe may be one of them, if it came late)."""
    return server.metrics().get('inference_requests_total{code="200"}', 0.0)


def generation(server: Server) -> float:
    return server.metrics()["inference_route_generation"]


def answers(server: Server, n: int) -> list[float]:
    """What ``n`` requests of x = 3 got (the serving version answers 3, the candidate 6)."""
    got = [server.post({"dataframe_records": [{"x": 3.0}]}) for _ in range(n)]
    assert [a.status_code for a in got] == [200] * n, [a.text for a in got]
    return [a.json()["predictions"][0] for a in got]


def test_a_canary_answers_its_share_set_while_the_server_runs_then_none(routed: tuple[Pair, Path]) -> None:
    pair, route = routed
    serving_before, candidate_before = ok(pair.serving), ok(pair.candidate)
    assert generation(pair.serving) == 0 and answers(pair.serving, 4) == [3.0] * 4
    write(route, {"generation": 5, "canary": {"url": f"{pair.candidate.url}/invocations", "share": 0.25}})
    wait_for(lambda: generation(pair.serving) == 5, "the route file to be read")
    got = answers(pair.serving, 40)
    assert got.count(6.0) == 10 and got[3::4] == [6.0] * 10, got  # every fourth: evenly spaced
    # Each server counts what it answered: the serving one 4 + 30, the canary 10.
    assert ok(pair.serving) - serving_before == 34 and ok(pair.candidate) - candidate_before == 10
    assert pair.serving.metrics()['inference_route_requests_total{code="200"}'] == 10

    write(route, {"generation": 6})
    wait_for(lambda: generation(pair.serving) == 6, "the route file to be read again")
    assert answers(pair.serving, 12) == [3.0] * 12
    assert ok(pair.candidate) - candidate_before == 10


def test_a_canary_that_is_gone_or_not_ready_costs_no_client_a_failed_request(
    routed: tuple[Pair, Path],
) -> None:
    pair, route = routed
    before = ok(pair.serving)
    dead = f"http://127.0.0.1:{_free_port()}/invocations"  # nothing listens there
    write(route, {"generation": 1, "canary": {"url": dead, "share": 0.5, "timeout_s": 2}})
    wait_for(lambda: generation(pair.serving) == 1, "the route file to be read")
    assert answers(pair.serving, 10) == [3.0] * 10
    metrics = pair.serving.metrics()
    assert metrics['inference_route_requests_total{code="none"}'] == 5
    assert metrics['inference_requests_total{code="200"}'] - before == 10  # all of them answered here

    # A canary that answers 503 (not ready, overloaded, draining): answered here too.
    busy = Busy()
    try:
        write(route, {"generation": 3, "canary": {"url": f"{busy.url}/invocations", "share": 1}})
        wait_for(lambda: generation(pair.serving) == 3, "the route file to be read")
        assert answers(pair.serving, 4) == [3.0] * 4 and busy.asked == 4
        assert pair.serving.metrics()['inference_route_requests_total{code="503"}'] == 4
    finally:
        busy.close()

    # Any other answer of the canary is the client's, as it gave it (a URL it serves no POST on: 405).
    write(route, {"generation": 4, "canary": {"url": f"{pair.candidate.url}/missing", "share": 1}})
    wait_for(lambda: generation(pair.serving) == 4, "the route file to be read")
    assert pair.serving.post({"dataframe_records": [{"x": 3.0}]}).status_code == 405


def test_a_shadow_set_by_the_route_file_is_compared_and_clients_get_the_serving_answers(
    routed: tuple[Pair, Path],
) -> None:
    pair, route = routed
    write(route, {"generation": 3, "shadow": {"url": f"{pair.candidate.url}/invocations", "share": 0.5}})
    wait_for(lambda: generation(pair.serving) == 3, "the route file to be read")
    got = [pair.serving.post({"dataframe_records": [{"x": float(x)}]}).json()["predictions"] for x in range(1, 13)]
    assert got == [[float(x)] for x in range(1, 13)]
    # Copies of x = 2, 4, ..., 12: 6 and 12 disagree.
    wait_for(
        lambda: pair.serving.metrics().get('inference_shadow_rows_total{result="disagree"}') == 2, "the comparisons"
    )
    assert pair.serving.metrics()['inference_shadow_rows_total{result="agree"}'] == 4

    route.write_text("{not json")  # a bad file keeps the last good route
    assert pair.serving.post({"dataframe_records": [{"x": 3.0}]}).status_code == 200
    assert generation(pair.serving) == 3 and "route file" in pair.serving.log()
    route.unlink()  # no file: nothing
    wait_for(lambda: generation(pair.serving) == 0, "the route to end")
    assert "no shadow" in pair.serving.log()


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ([], "must hold a JSON object"),
        ({"generation": -1}, "generation=-1"),
        ({"canary": {"url": "http://a/x", "share": 0.1}, "shadow": {"url": "http://a/x"}}, "not both"),
        ({"canary": {"url": "https://a/x", "share": 0.1}}, "canary.url='https://a/x' must be an http URL"),
        ({"canary": {"url": "http://a/x", "share": 0}}, "canary.share=0 must be"),
        ({"canary": {"url": "http://a/x", "share": 0.1, "weight": 1}}, "canary: unknown field(s) weight"),
        ({"shadow": {"share": 0.1}}, "shadow.url is missing"),
        ({"shadow": {"url": "http://a/x", "share": 2}}, "SHADOW_SHARE='2' must be above 0"),
        ({"canary": "http://a/x"}, "canary must be a JSON object"),
        ({"split": {}}, "unknown field(s) split"),
    ],
)
def test_a_bad_route_file_names_what_is_wrong(content: object, fragment: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse(content)
    assert fragment in str(raised.value)
