"""The driver of `bench/checkpoint-throughput`: starts keel-checkpoint on a free port with a
store and a database of its own, makes a file of SIZE_MB, and times, each REPEATS times
(median): a plain `cp` of the file, `keel checkpoint upload` of a directory holding it (hash,
send, verify on arrival, store, commit) and `keel checkpoint download` (stream, verify,
write). Prints MB/s side by side and the ratios to the copy.

    python bench/checkpoint_throughput.py KEEL KEEL_CHECKPOINT SIZE_MB REPEATS
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid


def timed(args, env=None):
    start = time.perf_counter()
    out = subprocess.run(args, check=True, capture_output=True, text=True, env=env)
    return time.perf_counter() - start, out.stdout.strip()


def main():
    keel, service, size_mb, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    work = tempfile.mkdtemp(prefix="keel-ckpt-bench-", dir=os.environ.get("BENCH_DIR"))
    database = f"keel_bench_{uuid.uuid4().hex}"
    env = dict(os.environ, KEEL_CHECKPOINT__LISTEN="127.0.0.1:0",
               KEEL_CHECKPOINT__DATABASE_URL=f"postgres://postgres@127.0.0.1:5432/{database}",
               KEEL_CHECKPOINT__STORAGE__ROOT=os.path.join(work, "store"),
               KEEL_CHECKPOINT__SUBJECT_PREFIX=f"bench.{uuid.uuid4().hex}", KEEL_LOG="warn")
    proc = subprocess.Popen([service], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = line.split("listening on ")[1].strip()
        source = os.path.join(work, "src")
        os.makedirs(source)
        path = os.path.join(source, "model.safetensors")
        with open(path, "wb") as f:
            for _ in range(size_mb):
                f.write(os.urandom(1 << 20))
        client_env = dict(os.environ, KEEL_CHECKPOINT_URL=url)
        copy, upload, download = [], [], []
        for i in range(repeats):
            t, _ = timed(["cp", path, os.path.join(work, f"copy-{i}")])
            copy.append(t)
            # A new file each time: identical content would be deduplicated and not sent.
            with open(path, "r+b") as f:
                f.write(os.urandom(16))
            t, checkpoint = timed([keel, "checkpoint", "upload", source, "--run", "bench", "--step", str(i)], client_env)
            upload.append(t)
            t, _ = timed([keel, "checkpoint", "download", checkpoint, "--out", os.path.join(work, f"down-{i}")], client_env)
            download.append(t)
            shutil.rmtree(os.path.join(work, f"down-{i}"))
            os.remove(os.path.join(work, f"copy-{i}"))
        rows = [("cp (reference)", copy), ("keel checkpoint upload", upload), ("keel checkpoint download", download)]
        base = size_mb / statistics.median(copy)
        print(f"file: {size_mb} MiB   repeats: {repeats} (median)   host CPUs: {os.cpu_count()}")
        print(f"{'operation':<28}{'seconds':>10}{'MB/s':>10}{'ratio to cp':>14}")
        for name, times in rows:
            seconds = statistics.median(times)
            rate = size_mb / seconds
            print(f"{name:<28}{seconds:>10.3f}{rate:>10.1f}{rate / base:>14.2f}")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-c", f"DROP DATABASE IF EXISTS {database} WITH (FORCE)"],
                       capture_output=True)


if __name__ == "__main__":
    main()
