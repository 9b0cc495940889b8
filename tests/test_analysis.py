"""Judging a new version by live traffic (blocks/base/analysis.py), over the metrics text the model server renders
(runtime/metrics.py, runtime/shadow.py): the gates, the p99 from the histogram, replicas added, restarts."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from blocks.base.analysis import Sample, Verdict, Window, judge
from blocks.errors import ConfigurationError
from blocks.specs import RolloutPolicy
from runtime.metrics import Metrics
from runtime.shadow import Shadow, ShadowSettings


def server(ok: int, errors: int = 0, seconds: float = 0.003, agree: int = 0, disagree: int = 0) -> Metrics:
    """A server's metrics after ``ok`` 200s and ``errors`` 500s, each taking ``seconds``."""
    metrics = Metrics()
    for _ in range(ok):
        metrics.observe_request(200, seconds)
    for _ in range(errors):
        metrics.observe_request(500, seconds)
    return metrics


def text(metrics: Metrics, shadow: Shadow | None = None) -> str:
    return metrics.render(0, True, shadow.render() if shadow is not None else None).decode()


def window(ok: int, errors: int = 0, seconds: float = 0.003) -> Window:
    return Sample.parse(text(server(ok, errors, seconds))) - Sample()


CANARY = RolloutPolicy(strategy="canary", share=0.1, min_requests=50)


def test_a_healthy_canary_passes_with_its_numbers() -> None:
    verdict = judge(CANARY, window(900, 1), window(100))
    assert verdict.passed and verdict.summary() == "passed"
    assert verdict.numbers["candidate_requests"] == 100 and verdict.numbers["current_error_rate"] == round(1 / 901, 6)
    # 0.003 s lies in the (2.5 ms, 5 ms] bucket: p99 interpolated as Prometheus does, 2.5 + 2.5 * 0.99.
    assert verdict.numbers["candidate_p99_ms"] == pytest.approx(4.975)


def test_a_canary_failing_a_fifth_of_its_requests_fails_naming_the_rates() -> None:
    verdict = judge(CANARY, window(900), window(80, 20))
    assert not verdict.passed and verdict.numbers["candidate_error_rate"] == 0.2
    assert verdict.reasons == ["error rate 20.00% against 0.00% for the version serving (max_error_rate_increase=0.01)"]


def test_requests_routed_to_a_canary_that_got_no_answer_count_as_its_failures() -> None:
    serving = Sample.parse(text(server(900)) + 'inference_route_requests_total{code="none"} 20\n') - Sample()
    verdict = judge(CANARY, serving, window(80))
    assert not verdict.passed and verdict.numbers["candidate_requests"] == 100
    assert verdict.numbers["candidate_error_rate"] == 0.2
    shadow = RolloutPolicy(strategy="shadow", share=0.1, min_requests=50)  # a shadow is routed nothing
    assert judge(shadow, serving, window(80)).numbers["candidate_requests"] == 80


def test_a_slower_canary_fails_on_p99_and_one_within_the_slack_passes() -> None:
    slow = judge(CANARY, window(900, seconds=0.02), window(100, seconds=0.2))
    assert not slow.passed and "p99 latency" in slow.reasons[0] and slow.numbers["candidate_p99_ms"] > 100
    near = judge(CANARY, window(900, seconds=0.0004), window(100, seconds=0.004))  # 10x, but a few ms
    assert near.passed, near.reasons


def test_too_little_traffic_is_not_a_pass() -> None:
    verdict = judge(CANARY, window(900), window(10))
    assert not verdict.passed and "fewer than min_requests=50" in verdict.reasons[0]


def test_a_shadow_that_disagrees_on_a_third_of_the_rows_fails() -> None:
    policy = RolloutPolicy(strategy="shadow", share=1, min_requests=50, min_agreement=0.95)
    shadow = Shadow(ShadowSettings(url="http://shadow:8080/invocations"))
    shadow.codes, shadow.rows = {"200": 90}, {"agree": 60, "disagree": 30}
    serving = Sample.parse(text(server(90), shadow)) - Sample()
    verdict = judge(policy, serving, window(90))
    assert not verdict.passed and verdict.numbers["agreement"] == round(60 / 90, 6)
    assert verdict.reasons == ["66.7% of 90 rows agree with the version serving (min_agreement=0.95)"]
    shadow.rows = {"agree": 90, "disagree": 0}
    assert judge(policy, Sample.parse(text(server(90), shadow)) - Sample(), window(90)).passed
    shadow.codes = {"200": 60, "none": 30}  # a third of the copies unanswered
    unanswered = judge(policy, Sample.parse(text(server(90), shadow)) - Sample(), window(60))
    assert not unanswered.passed and "30 of 90 copies got no answer" in unanswered.reasons[0]


def test_replicas_add_up_and_a_window_is_the_difference_of_two_samples() -> None:
    a, b = server(100, 1), server(50)
    before = Sample.parse(text(a)) + Sample.parse(text(b))
    for _ in range(10):
        a.observe_request(500, 0.003)
        b.observe_request(200, 0.003)
    w = (Sample.parse(text(a)) + Sample.parse(text(b))) - before
    assert (w.answered, w.errors, w.error_rate) == (20, 10, 0.5)
    restarted = Sample.parse(text(server(5))) - Sample.parse(text(server(100)))  # counters went back: from 0
    assert restarted.answered == 5


def test_bad_policies_name_the_field() -> None:
    with pytest.raises(ValidationError, match="a canary answers at most half"):
        RolloutPolicy(strategy="canary", share=0.6)
    with pytest.raises(ValidationError, match="share"):
        RolloutPolicy(strategy="shadow", share=0)
    assert RolloutPolicy(strategy="shadow", share=1).share == 1


WORKLOAD = """\
name: r
train: {{command: [python, t.py]}}
promotion: {{metric: m}}
serve:
  rollout: {{strategy: canary, share: 0.2}}
{own}"""


def test_a_rollout_the_stack_cannot_do_is_refused_before_anything_runs(tmp_path: Path) -> None:
    from blocks.docker.serving import DockerServing
    from blocks.local.serving import LocalServing
    from blocks.plan import check_rollout, plan_run
    from blocks.specs import PromotionPolicy, ServingSpec, TrainingSpec
    from blocks.workload.source import load_workload

    (tmp_path / "gpuferry.yaml").write_text(WORKLOAD.format(own=""))
    work = load_workload(str(tmp_path))
    run = plan_run(work, TrainingSpec(), ServingSpec(), PromotionPolicy())
    assert run.serving.rollout is not None and (run.serving.rollout.strategy, run.serving.rollout.share) == (
        "canary",
        0.2,
    )
    with pytest.raises(ConfigurationError, match=r"stack.serving \(LocalServing\) rolls out rolling only"):
        check_rollout(SimpleNamespace(serving=LocalServing()), run)
    check_rollout(SimpleNamespace(serving=DockerServing()), run)
    rolling = plan_run(work, TrainingSpec(), ServingSpec(rollout=RolloutPolicy()), PromotionPolicy())
    assert rolling.serving.rollout is not None and rolling.serving.rollout.strategy == "rolling"  # the run's wins
    check_rollout(SimpleNamespace(serving=LocalServing()), rolling)
    own = tmp_path / "own"
    own.mkdir()
    (own / "gpuferry.yaml").write_text(WORKLOAD.format(own="  command: [python, serve.py]\n  port: 9000\n"))
    run = plan_run(load_workload(str(own)), TrainingSpec(), ServingSpec(), PromotionPolicy())
    with pytest.raises(ConfigurationError, match="judges the new version by the /metrics of gpuferry's model server"):
        check_rollout(SimpleNamespace(serving=DockerServing()), run)


def test_a_failed_canary_is_recorded_with_its_numbers() -> None:
    from blocks.base.serving import DeployOutcome, Release
    from blocks.errors import CanaryFailed
    from blocks.records import ServerSpec

    release = Release(model_name="m", version="7", model_uri="s3://b/m/7", server=ServerSpec())
    numbers = {"strategy": "canary", "candidate_error_rate": 0.2, "current_error_rate": 0.0, "decision_s": 1.25}
    failed = CanaryFailed("v7 failed", version="7", serving_version="6", reasons=["error rate 20%"], numbers=numbers)
    outcome = DeployOutcome.from_error(release, failed)
    tags = outcome.tags()
    assert (tags["deploy.status"], tags["deploy.failed_version"], tags["deploy.rolled_back_to"]) == (
        "canary_failed",
        "7",
        "6",
    )
    assert tags["deploy.reason"] == "error rate 20%" and tags["deploy.rollout.candidate_error_rate"] == "0.2"
    assert "| candidate_error_rate | 0.2 |" in outcome.markdown() and "v6 serves every request" in outcome.markdown()


def test_a_window_ends_at_its_time_or_once_the_new_version_answered_enough() -> None:
    from blocks.base.analysis import observe

    now = [0.0]
    served = {"current": server(0), "candidate": server(0)}

    def sleep(seconds: float) -> None:  # a second passes; each version answers its share of it
        now[0] += seconds
        for _ in range(9):
            served["current"].observe_request(200, 0.003)
        served["candidate"].observe_request(200, 0.003)

    def watch(policy: RolloutPolicy, **options: Any) -> Verdict:
        current, candidate = served["current"], served["candidate"]
        return observe(
            policy,
            lambda: Sample.parse(text(current)),
            lambda: Sample.parse(text(candidate)),
            clock=lambda: now[0],
            sleep=sleep,
            **options,
        )

    seen: list[tuple[float, int]] = []
    policy = RolloutPolicy(strategy="canary", share=0.1, window_seconds=60, min_requests=10)
    verdict = watch(policy, progress=lambda seconds, so_far: seen.append((seconds, so_far.answered)))
    assert verdict.passed and verdict.numbers["window_seconds"] == 60
    assert (verdict.numbers["current_requests"], verdict.numbers["candidate_requests"]) == (540, 60)
    assert seen == [(10.0, 10), (20.0, 20), (30.0, 30), (40.0, 40), (50.0, 50), (60.0, 60)]
    early = RolloutPolicy(strategy="canary", share=0.1, window_seconds=60, window_requests=25, min_requests=10)
    assert watch(early).numbers["window_seconds"] == 25
    asked = iter([None, None, "abort"])  # decided by hand in the third second
    aborted = watch(policy, control=lambda: next(asked))
    assert not aborted.passed and aborted.decision == "abort" and aborted.numbers["window_seconds"] == 3
    assert aborted.reasons == ["aborted by hand (gpuferry rollout abort)"]
    promoted = watch(policy, control=lambda: "promote")
    assert promoted.passed and promoted.decision == "promote" and promoted.numbers["candidate_requests"] == 1


def test_a_backend_that_judges_no_rollout_has_nothing_to_decide(tmp_path: Path) -> None:
    import os
    import subprocess

    from blocks.local.serving import LocalServing

    local = LocalServing(state_dir=str(tmp_path))
    assert local.rollout_status("svc") is None
    with pytest.raises(ConfigurationError, match="LocalServing judges no rollout by live traffic: nothing to abort"):
        local.decide_rollout("svc", "abort")
    gpuferry = Path(__file__).resolve().parent.parent / ".venv/bin/gpuferry"
    env = {**os.environ, "GPUFERRY_HOME": str(tmp_path)}
    done = subprocess.run(
        [str(gpuferry), "rollout", "promote", "no-such-service"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2 and "no version of 'no-such-service' serves" in done.stderr, done.stderr


@pytest.mark.usefixtures("prefect_server")
def test_a_window_shows_its_progress_and_verdict_on_the_prefect_run() -> None:
    from prefect import flow, get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from blocks.base.analysis import run_window

    now = [0.0]
    served = {"current": server(0), "candidate": server(0)}
    seen: list[float] = []

    def sleep(seconds: float) -> None:  # a second passes; the canary fails one request in five
        if now[0] in (10.0, 20.0):  # the window reported its progress a moment ago
            seen.append(float(shown()[0].data))
        now[0] += seconds
        for _ in range(9):
            served["current"].observe_request(200, 0.003)
        failing = int(now[0]) % 5 == 0
        served["candidate"].observe_request(500 if failing else 200, 0.003)

    def shown() -> list[Any]:
        with get_client(sync_client=True) as client:
            wanted = ArtifactFilter(key=ArtifactFilterKey(any_=["rollout-svc-a"]))
            return client.read_latest_artifacts(artifact_filter=wanted)

    @flow
    def deploying() -> tuple[dict[str, Any], list[str]]:
        policy = RolloutPolicy(strategy="canary", share=0.1, window_seconds=30, min_requests=10)
        return run_window(
            policy,
            service="svc_A",  # not an artifact key as it is: the key is made one
            version="7",
            serving_version="6",
            current=lambda: Sample.parse(text(served["current"])),
            candidate=lambda: Sample.parse(text(served["candidate"])),
            publish=lambda state: None,
            decision=lambda: None,
            log=SimpleNamespace(info=lambda *args: None),
            clock=lambda: now[0],
            sleep=sleep,
        )

    numbers, reasons = deploying()
    assert reasons and "error rate 20.00%" in reasons[0] and numbers["candidate_requests"] == 30
    assert seen == [pytest.approx(100 / 3), pytest.approx(200 / 3)]  # the share of the window gone, every 10 s
    (artifact,) = shown()
    assert artifact.type == "progress" and float(artifact.data) == 100.0
    assert artifact.description.startswith("v7 failed its canary: error rate 20.00%"), artifact.description
