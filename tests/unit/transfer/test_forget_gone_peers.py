"""A process that writes into peers' segments unmaps a peer's once its name is gone (the
peer died or stopped): a restarted decode worker's new pool is mapped, its dead
predecessor's no longer held."""

from libs.transfer import SharedSegment
from libs.transfer.segment import new_segment_name


def test_mapping_a_new_peer_segment_unmaps_those_whose_owners_are_gone(segments):
    writer = segments.engine("host-a")
    own = segments.segment(writer, 4096)
    first = SharedSegment.create(new_segment_name("decode-0", "kv"), 4096)  # the peer's pool
    second = SharedSegment.create(new_segment_name("decode-0", "kv"), 4096)  # its restart's
    segments.segments += [first, second]
    mapped_first = writer.segment(first.name)
    assert writer.segment(first.name) is mapped_first  # mapped once, then reused
    first.close()  # the owner is gone: its name is removed
    writer.segment(second.name)
    assert mapped_first.tensor is None  # unmapped when the next peer segment was mapped
    assert writer.segment(own.name) is own  # its own segments stay registered
    assert writer.forget_gone() == []
