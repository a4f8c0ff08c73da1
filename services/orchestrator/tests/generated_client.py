"""The runs API through the Python client openapi-python-client generated from
`openapi/keel.yaml` (`tests/generated_client.rs` generates it and runs this with the
package on PYTHONPATH): submit, list, show, cancel and the events stream against a running
orchestrator, every answer a typed object of the client's models.

Usage: generated_client.py BASE_URL TOKEN MODEL_DIR
"""

import json
import sys
import threading
import uuid

import httpx
from keel_client import AuthenticatedClient, Client
from keel_client.api.default import cancel, events, list_, show, submit
from keel_client.models import (
    Algorithm,
    FieldError,
    InvalidSpecError,
    KeelError,
    Run,
    RunEventCheckpoint,
    RunEventRecord,
    RunEventStatus,
    RunEventStep,
    RunList,
    RunSpec,
    RunStatus,
)


def check(condition, what):
    if not condition:
        raise AssertionError(what)


def server_sent_events(lines):
    """Yields (id, event, data) per event of an SSE stream's lines; comments are skipped."""
    fields = {}
    for line in lines:
        if line == "":
            if "data" in fields:
                yield fields.get("id"), fields.get("event"), fields["data"]
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value
    if "data" in fields:
        yield fields.get("id"), fields.get("event"), fields["data"]


def record_of(event_id, kind, data):
    """One SSE event as the client's RunEventRecord, checked against the event's id and name."""
    record = RunEventRecord.from_dict(json.loads(data))
    check(str(record.seq) == event_id, f"event id {event_id} is not the record's seq {record.seq}")
    check(record.event.kind.value == kind, f"event name {kind} is not the record's kind {record.event.kind}")
    check(
        isinstance(record.event, (RunEventStatus, RunEventStep, RunEventCheckpoint)),
        f"the event is not typed: {record.event!r}",
    )
    return record


def sft_spec(model, micro_batch_size=4, max_num_steps=2, **extra):
    """A small arithmetic SFT spec on `model`, as the generated `RunSpec`."""
    return RunSpec.from_dict(
        {
            **extra,
            "algorithm": "sft",
            "model": {"path": model},
            "data": {"train": {"kind": "arithmetic", "size": 16}},
            "training": {"loss": {"type": "nll"}, "global_batch_size": 8, "micro_batch_size": micro_batch_size},
            "max_num_steps": max_num_steps,
        }
    )


def main():
    base_url, token, model = sys.argv[1:4]
    timeout = httpx.Timeout(30.0)
    client = AuthenticatedClient(base_url=base_url, token=token, timeout=timeout, raise_on_unexpected_status=True)

    # Without the token: 401 with the error body, typed.
    anonymous = Client(base_url=base_url, timeout=timeout, raise_on_unexpected_status=True)
    refused = list_.sync(client=anonymous)
    check(isinstance(refused, KeelError), f"no token: {refused!r}")
    check(refused.error.type_ == "unauthorized", f"no token: {refused.error!r}")

    # A spec the orchestrator refuses: 422 with every problem, typed.
    bad = sft_spec(model, micro_batch_size=0, max_num_steps=0)
    refused = submit.sync(client=client, body=bad)
    check(isinstance(refused, InvalidSpecError), f"a bad spec: {refused!r}")
    check(refused.error.type_ == "invalid_spec", f"a bad spec: {refused.error!r}")
    check(all(isinstance(p, FieldError) for p in refused.error.problems), f"problems: {refused.error.problems!r}")
    fields = {p.field for p in refused.error.problems}
    check("max_num_steps" in fields, f"max_num_steps is not among the problems: {fields}")

    # Submit: the run waits in `queued` (no trainer serves this orchestrator's prefix).
    spec = sft_spec(model, name="generated-client")
    run = submit.sync(client=client, body=spec)
    check(isinstance(run, Run), f"submit: {run!r}")
    check(run.status == RunStatus.QUEUED and run.algorithm == Algorithm.SFT, f"submit: {run!r}")
    check(isinstance(run.spec, RunSpec) and run.spec.max_num_steps == 2, f"the run's spec: {run.spec!r}")

    # The event stream, read live while the run is cancelled.
    received = []
    connected = threading.Event()
    failed = []

    def follow():
        try:
            request = events._get_kwargs(id=run.id)
            with client.get_httpx_client().stream(**request) as response:
                check(response.status_code == 200, f"events: {response.status_code}")
                check(response.headers["content-type"].startswith("text/event-stream"), "events: content type")
                connected.set()
                for event_id, kind, data in server_sent_events(response.iter_lines()):
                    received.append(record_of(event_id, kind, data))
                    connected.set()
        except Exception as e:  # reported by the main thread
            failed.append(e)
            connected.set()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    check(connected.wait(30), "the event stream did not open within 30 s")

    # List (with the scheme's name in lower case, as RFC 9110 allows) and show.
    lower = AuthenticatedClient(base_url=base_url, token=token, prefix="bearer", timeout=timeout)
    runs = list_.sync(client=lower, limit=200, status=RunStatus.QUEUED)
    check(isinstance(runs, RunList), f"list: {runs!r}")
    check(all(isinstance(r, Run) for r in runs.runs), "list: untyped runs")
    check(run.id in [r.id for r in runs.runs], f"list: {run.id} is not listed")
    refused = list_.sync(client=client, limit=0)
    check(isinstance(refused, KeelError) and refused.error.type_ == "invalid_request", f"limit 0: {refused!r}")
    shown = show.sync(client=client, id=run.id)
    check(isinstance(shown, Run) and shown.id == run.id and shown.name == "generated-client", f"show: {shown!r}")
    missing = show.sync(client=client, id=uuid.uuid4())
    check(isinstance(missing, KeelError) and missing.error.type_ == "not_found", f"show a missing run: {missing!r}")

    # Cancel: at once for a queued run; a second cancel is a conflict.
    cancelled = cancel.sync(client=client, id=run.id)
    check(isinstance(cancelled, Run) and cancelled.status == RunStatus.CANCELLED, f"cancel: {cancelled!r}")
    again = cancel.sync(client=client, id=run.id)
    check(isinstance(again, KeelError) and again.error.type_ == "conflict", f"cancel again: {again!r}")

    follower.join(30)
    check(not follower.is_alive(), "the event stream did not end after the run's final status")
    if failed:
        raise failed[0]
    statuses = [r.event.status for r in received if isinstance(r.event, RunEventStatus)]
    check(statuses == [RunStatus.QUEUED, RunStatus.CANCELLED], f"status events: {statuses}")

    # The whole stream again through the generated operation: it ends at the final status.
    text = events.sync(client=client, id=run.id)
    check(isinstance(text, str), f"events: {text!r}")
    replayed = [record_of(*e) for e in server_sent_events(text.splitlines())]
    check([r.seq for r in replayed] == [r.seq for r in received], "the replayed stream differs")
    print(f"ok: run {run.id}, {len(received)} events")


if __name__ == "__main__":
    main()
