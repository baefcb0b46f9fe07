"""Reading Mooncake-format traces: windows, and refusing what breaks the format."""

import json

import pytest

from kvserve.replay.trace import TraceError, TraceRequest, arrival_offsets_ms, load_trace


def write(tmp_path, rows) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


ROWS = [
    {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 512, "output_length": 0, "hash_ids": [0]},
    {"timestamp": 2000, "input_length": 1025, "output_length": 7, "hash_ids": [0, 1, 9]},
]


def test_window(tmp_path):
    path = write(tmp_path, ROWS)
    assert load_trace(path, max_requests=2, start=1) == [
        TraceRequest(1, 1500, 512, 0, (0,)),
        TraceRequest(2, 2000, 1025, 7, (0, 1, 9)),
    ]
    assert len(load_trace(path)) == 3


@pytest.mark.parametrize(
    "row, message",
    [
        ({"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0]}, "1 hash ids for 600"),
        ({"timestamp": 0, "input_length": 600, "hash_ids": [0, 1]}, "not a trace request"),
        ({"timestamp": -1, "input_length": 10, "output_length": 3, "hash_ids": [0]}, "negative timestamp"),
    ],
)
def test_bad_rows_are_refused_with_their_line(tmp_path, row, message):
    path = write(tmp_path, [ROWS[0], row])
    with pytest.raises(TraceError, match=f"t.jsonl:2: .*{message}"):
        load_trace(path)


def test_missing_file_and_empty_window(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests from index 3"):
        load_trace(write(tmp_path, ROWS), start=3)


def test_arrivals_keep_timestamps_or_spread_each_bucket_to_the_next():
    requests = [
        TraceRequest(0, 1000, 1, 1, (0,)),
        TraceRequest(1, 1000, 1, 1, (0,)),
        TraceRequest(2, 1000, 1, 1, (0,)),
        TraceRequest(3, 4000, 1, 1, (0,)),
        TraceRequest(4, 5000, 1, 1, (0,)),
        TraceRequest(5, 5000, 1, 1, (0,)),
    ]
    assert arrival_offsets_ms(requests) == {0: 0.0, 1: 0.0, 2: 0.0, 3: 3000.0, 4: 4000.0, 5: 4000.0}
    # 3 over the 3 s to the next stamp; 1 alone; the last bucket gets the gap before it (1 s)
    assert arrival_offsets_ms(requests, spread=True) == {0: 0.0, 1: 1000.0, 2: 2000.0, 3: 3000.0, 4: 4000.0, 5: 4500.0}
