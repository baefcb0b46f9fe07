import pytest

from libs.transfer import SharedSegment, TransferEngine
from libs.transfer.segment import new_segment_name


class Segments:
    """Creates segments and closes them (and the engines) after the test."""

    def __init__(self) -> None:
        self.engines: list[TransferEngine] = []
        self.segments: list[SharedSegment] = []

    def engine(self, *args, **kwargs) -> TransferEngine:
        engine = TransferEngine(*args, **kwargs)
        self.engines.append(engine)
        return engine

    def segment(self, engine: TransferEngine, nbytes: int) -> SharedSegment:
        segment = SharedSegment.create(new_segment_name("test", "seg"), nbytes)
        engine.register(segment)
        self.segments.append(segment)
        return segment

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        for segment in self.segments:
            segment.close()


@pytest.fixture
def segments():
    made = Segments()
    yield made
    made.close()
