"""Reads a W&B offline run file (`run-<id>.wandb`) into JSON, parsing every record with
W&B's own protobuf definitions (`wandb.proto.wandb_internal_pb2`); the block framing (W&B's
record log: 32 KiB blocks, chunks of CRC-32 over type and bytes, length, type) is read here,
since wandb 0.30 dropped its Python reader. With --real DIR it first makes a real offline run
with wandb itself in DIR and checks that this reader reads it, so that the framing read here
is W&B's and not only Keel's.

  wandb_records.py RUN_FILE [--real DIR]

Prints {"records": [kinds in order], "nums": [...], "run": {...}, "history": [[step,
{key: value}], ...], "summary": {key: value}, "exit_code": N}.
"""

import argparse
import glob
import json
import os
import struct
import time
import zlib

BLOCK = 32768


def payloads(path):
    data = open(path, "rb").read()
    assert struct.unpack_from("<4sHB", data, 0) == (b":W&B", 0xBEE1, 0), "not a W&B record log"
    pos, pending = 7, None
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            assert data[pos:pos + left] == b"\0" * left, f"block padding at {pos}"
            pos += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + 7:pos + 7 + length]
        assert len(chunk) == length, f"a chunk at {pos} is cut short"
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"CRC of the chunk at {pos}"
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = None
        else:
            raise ValueError(f"chunk type {kind} at {pos}")
    assert pending is None, "the file ends inside a record"


def records(path):
    from wandb.proto import wandb_internal_pb2 as pb

    for raw in payloads(path):
        record = pb.Record()
        record.ParseFromString(raw)
        yield record


def key(item):
    return item.key or ".".join(item.nested_key)


def check_on_a_real_run(directory):
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    import wandb

    run = wandb.init(project="reader-check", dir=directory, config={"lr": 0.5})
    for step in (1, 2):
        run.log({"loss": 1.0 / step}, step=step)
    run.finish()
    # wandb's core process writes the file; on a busy machine it may still be writing when
    # finish() returns: wait (up to a minute) for the exit record.
    wandb.teardown()
    deadline = time.time() + 60
    while True:
        found = glob.glob(os.path.join(directory, "wandb", "offline-run-*", "run-*.wandb"))
        kinds = []
        if len(found) == 1:
            read = list(records(found[0]))
            kinds = [r.WhichOneof("record_type") for r in read]
        if (kinds and kinds[-1] == "exit") or time.time() > deadline:
            break
        time.sleep(0.5)
    assert "run" in kinds and kinds[-1] == "exit", kinds
    losses = [(r.history.step.num, json.loads(i.value_json)) for r in read if r.WhichOneof("record_type") == "history"
              for i in r.history.item if key(i) == "loss"]
    assert losses == [(1, 1.0), (2, 0.5)], losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--real")
    args = parser.parse_args()
    if args.real:
        check_on_a_real_run(args.real)
    out = {"records": [], "nums": [], "history": [], "summary": {}, "exit_code": None}
    for record in records(args.path):
        kind = record.WhichOneof("record_type")
        out["records"].append(kind)
        out["nums"].append(record.num)
        if kind == "run":
            run = record.run
            out["run"] = {"run_id": run.run_id, "project": run.project, "display_name": run.display_name,
                          "tags": list(run.tags), "start_time": run.start_time.seconds,
                          "config": {key(i): json.loads(i.value_json) for i in run.config.update}}
        elif kind == "history":
            row = {key(i): json.loads(i.value_json) for i in record.history.item}
            out["history"].append([record.history.step.num, row])
        elif kind == "summary":
            out["summary"].update({key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    print(json.dumps(out))


if __name__ == "__main__":
    main()
