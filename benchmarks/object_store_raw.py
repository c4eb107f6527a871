"""Raw object-store client speed on a local SeaweedFS, to choose the client for issue 12.

A temporary measurement, not a checkpoint benchmark: the same bytes moved by s3fs (fsspec),
obstore and boto3 against one SeaweedFS server on 127.0.0.1 (tests/support/s3_server.py), plus
in-memory stores (fsspec `memory://`, obstore `MemoryStore`). Cases: put and get of one
256 MiB object; put and get of 512 objects of 0.5 MiB (each client's concurrent way);
8 parallel 32 MiB range reads from one object. Streaming writes go in 32 MiB `write()`
calls, as a checkpoint writer would issue them leaf by leaf. Repeats are interleaved
(every case once per round) and the median is reported.

    python benchmarks/object_store_raw.py [--repeats 5] [--only s3fs obstore boto3 memory]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import print_table  # noqa: E402

from tests.support.s3_server import REGION, SeaweedS3  # noqa: E402

MiB = 1 << 20
BIG = 256 * MiB
SMALL, COUNT = MiB // 2, 512
RANGE, RANGES = 32 * MiB, 8
WRITE_PIECE = 32 * MiB


def _payload(size: int) -> bytes:
    return os.urandom(size)


def _streamed(f, data: bytes) -> None:
    view = memoryview(data)
    for start in range(0, len(data), WRITE_PIECE):
        f.write(view[start : start + WRITE_PIECE])


def _check(got, want: bytes, what: str) -> None:
    if bytes(got) != want:
        raise AssertionError(f"{what}: read back different bytes")


def s3fs_cases(server: SeaweedS3, bucket: str, big: bytes, small: list[bytes]):
    import s3fs

    fs = s3fs.S3FileSystem(**server.storage_options, use_listings_cache=False)
    fs.pipe_file(f"{bucket}/s3fs/src", big)
    starts = [i * RANGE for i in range(RANGES)]
    ends = [s + RANGE for s in starts]
    small_paths = [f"{bucket}/s3fs/small/{i:04d}" for i in range(COUNT)]
    fs.pipe(dict(zip(small_paths, small, strict=True)))

    def open_write(block: int) -> Callable[[], None]:
        def run():
            with fs.open(f"{bucket}/s3fs/open-{block}", "wb", block_size=block * MiB) as f:
                _streamed(f, big)

        return run

    # botocore >= 1.36 computes and checks CRC32 checksums on every transfer by default;
    # "when_required" turns that off (the safetensors checkpoint carries its own hashes).
    lean = s3fs.S3FileSystem(
        **server.storage_options,
        use_listings_cache=False,
        config_kwargs={
            "request_checksum_calculation": "when_required",
            "response_checksum_validation": "when_required",
        },
    )

    def open_write_lean():
        with lean.open(f"{bucket}/s3fs/open-lean", "wb", block_size=50 * MiB) as f:
            _streamed(f, big)

    return {
        ("put 256 MiB", "s3fs pipe_file (50 MiB parts, concurrent)"): lambda: fs.pipe_file(
            f"{bucket}/s3fs/pipe", big
        ),
        ("put 256 MiB", "s3fs pipe_file, no checksums"): lambda: lean.pipe_file(
            f"{bucket}/s3fs/pipe-lean", big
        ),
        ("put 256 MiB", "s3fs open('wb', block 50 MiB), no checksums"): open_write_lean,
        ("get 256 MiB", "s3fs cat_file, no checksums"): lambda: _check(
            lean.cat_file(f"{bucket}/s3fs/src"), big, "s3fs cat_file"
        ),
        ("get 8x32 MiB ranges", "s3fs cat_ranges, no checksums"): lambda: lean.cat_ranges(
            [f"{bucket}/s3fs/src"] * RANGES, starts, ends
        ),
        ("put 256 MiB", "s3fs open('wb', block 5 MiB)"): open_write(5),
        ("put 256 MiB", "s3fs open('wb', block 50 MiB)"): open_write(50),
        ("put 256 MiB", "s3fs open('wb', block 100 MiB)"): open_write(100),
        ("get 256 MiB", "s3fs cat_file"): lambda: _check(
            fs.cat_file(f"{bucket}/s3fs/src"), big, "s3fs cat_file"
        ),
        ("get 8x32 MiB ranges", "s3fs cat_ranges"): lambda: fs.cat_ranges(
            [f"{bucket}/s3fs/src"] * RANGES, starts, ends
        ),
        ("put 512 x 0.5 MiB", "s3fs pipe(dict)"): lambda: fs.pipe(
            dict(zip(small_paths, small, strict=True))
        ),
        ("get 512 x 0.5 MiB", "s3fs cat(list)"): lambda: fs.cat(small_paths),
    }


def obstore_cases(server: SeaweedS3, bucket: str, big: bytes, small: list[bytes]):
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        bucket,
        endpoint=server.endpoint_url,
        access_key_id=server.key,
        secret_access_key=server.secret,
        region=REGION,
        client_options={"allow_http": True},
    )
    obstore.put(store, "obstore/src", big)
    starts = [i * RANGE for i in range(RANGES)]
    ends = [s + RANGE for s in starts]
    small_paths = [f"obstore/small/{i:04d}" for i in range(COUNT)]

    async def put_all():
        await asyncio.gather(
            *(obstore.put_async(store, p, d) for p, d in zip(small_paths, small, strict=True))
        )

    async def get_all():
        async def one(p):
            return await (await obstore.get_async(store, p)).bytes_async()

        return await asyncio.gather(*(one(p) for p in small_paths))

    asyncio.run(put_all())

    def put(chunk: int | None, concurrency: int = 12) -> Callable[[], None]:
        if chunk is None:
            return lambda: obstore.put(store, "obstore/put", big, use_multipart=False)
        return lambda: obstore.put(
            store, "obstore/put", big, chunk_size=chunk * MiB, max_concurrency=concurrency
        )

    return {
        ("put 256 MiB", "obstore put (single PUT)"): put(None),
        ("put 256 MiB", "obstore put (5 MiB parts, 12 concurrent)"): put(5),
        ("put 256 MiB", "obstore put (50 MiB parts, 12 concurrent)"): put(50),
        ("get 256 MiB", "obstore get().bytes()"): lambda: _check(
            obstore.get(store, "obstore/src").bytes(), big, "obstore get"
        ),
        ("get 8x32 MiB ranges", "obstore get_ranges"): lambda: obstore.get_ranges(
            store, "obstore/src", starts=starts, ends=ends
        ),
        ("put 512 x 0.5 MiB", "obstore put_async gather"): lambda: asyncio.run(put_all()),
        ("get 512 x 0.5 MiB", "obstore get_async gather"): lambda: asyncio.run(get_all()),
    }


def boto3_cases(server: SeaweedS3, bucket: str, big: bytes, small: list[bytes]):
    import io

    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.key,
        aws_secret_access_key=server.secret,
        region_name=REGION,
        config=Config(max_pool_connections=32),
    )
    client.put_object(Bucket=bucket, Key="boto3/src", Body=big)
    small_keys = [f"boto3/small/{i:04d}" for i in range(COUNT)]
    pool = ThreadPoolExecutor(16)
    list(
        pool.map(
            lambda kd: client.put_object(Bucket=bucket, Key=kd[0], Body=kd[1]),
            zip(small_keys, small, strict=True),
        )
    )
    transfer = TransferConfig(multipart_chunksize=50 * MiB, max_concurrency=10)

    def get_range(i: int) -> bytes:
        r = f"bytes={i * RANGE}-{(i + 1) * RANGE - 1}"
        return client.get_object(Bucket=bucket, Key="boto3/src", Range=r)["Body"].read()

    return {
        ("put 256 MiB", "boto3 put_object (single PUT)"): lambda: client.put_object(
            Bucket=bucket, Key="boto3/put", Body=big
        ),
        ("put 256 MiB", "boto3 upload_fileobj (50 MiB parts, 10 threads)"): lambda: (
            client.upload_fileobj(io.BytesIO(big), bucket, "boto3/put", Config=transfer)
        ),
        ("get 256 MiB", "boto3 get_object().read()"): lambda: _check(
            client.get_object(Bucket=bucket, Key="boto3/src")["Body"].read(), big, "boto3 get"
        ),
        ("get 8x32 MiB ranges", "boto3 get_object(Range) x8 threads"): lambda: list(
            pool.map(get_range, range(RANGES))
        ),
        ("put 512 x 0.5 MiB", "boto3 put_object, 16 threads"): lambda: list(
            pool.map(
                lambda kd: client.put_object(Bucket=bucket, Key=kd[0], Body=kd[1]),
                zip(small_keys, small, strict=True),
            )
        ),
        ("get 512 x 0.5 MiB", "boto3 get_object, 16 threads"): lambda: list(
            pool.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), small_keys)
        ),
    }


def memory_cases(big: bytes):
    import fsspec
    import obstore
    from obstore.store import MemoryStore

    fs = fsspec.filesystem("memory")
    store = MemoryStore()
    obstore.put(store, "src", big)
    fs.pipe_file("/bench-raw/src", big)

    def stream():
        with fs.open("/bench-raw/stream", "wb") as f:
            _streamed(f, big)

    return {
        ("memory put 256 MiB", "fsspec memory:// open('wb') streamed"): stream,
        ("memory put 256 MiB", "fsspec memory:// pipe_file"): lambda: fs.pipe_file(
            "/bench-raw/pipe", big
        ),
        ("memory get 256 MiB", "fsspec memory:// cat_file"): lambda: fs.cat_file("/bench-raw/src"),
        ("memory put 256 MiB", "obstore MemoryStore put"): lambda: obstore.put(store, "put", big),
        ("memory get 256 MiB", "obstore MemoryStore get().bytes()"): lambda: obstore.get(
            store, "src"
        ).bytes(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--only",
        nargs="+",
        default=["s3fs", "obstore", "boto3", "memory"],
        choices=["s3fs", "obstore", "boto3", "memory"],
    )
    args = parser.parse_args()

    big = _payload(BIG)
    small = [_payload(SMALL) for _ in range(COUNT)]
    with SeaweedS3() as server:
        print(f"SeaweedFS ready in {server.start_seconds:.2f} s at {server.endpoint_url}")
        cases: dict[tuple[str, str], Callable[[], object]] = {}
        builders = {
            "s3fs": lambda: s3fs_cases(server, bucket("s3fs"), big, small),
            "obstore": lambda: obstore_cases(server, bucket("obstore"), big, small),
            "boto3": lambda: boto3_cases(server, bucket("boto3"), big, small),
            "memory": lambda: memory_cases(big),
        }

        def bucket(name: str) -> str:
            return server.create_bucket(f"bench-{name}").removeprefix("s3://")

        for name in args.only:
            cases.update(builders[name]())
        for run in cases.values():  # warm-up: connections, first volume growth
            run()
        samples: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
        for _ in range(args.repeats):
            for key, run in cases.items():
                start = time.perf_counter()
                run()
                samples[key].append(time.perf_counter() - start)

    sizes = {"256 MiB": BIG, "0.5 MiB": SMALL * COUNT, "ranges": RANGE * RANGES}
    rows, summary = [], {}
    for (operation, method), times in samples.items():
        median = statistics.median(times)
        size = next(v for k, v in sizes.items() if k in operation)
        rows.append(
            [
                operation,
                method,
                f"{median * 1e3:.0f}",
                f"{size / MiB / median:.0f}",
                f"{min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}",
            ]
        )
        summary[f"{operation} | {method}"] = round(median, 4)
    rows.sort(key=lambda r: (r[0], float(r[2])))
    print_table(
        f"raw object-store clients, median of {args.repeats} interleaved repeats",
        ["operation", "method", "median ms", "MiB/s", "range ms"],
        rows,
    )
    print(json.dumps({"benchmark": "object_store_raw", "seconds": summary}))


if __name__ == "__main__":
    main()
