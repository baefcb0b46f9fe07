"""A request for n sequences is one prefill and n members of its decode batch: the
conductor predicts its TBT with n more sequences and books n on its decode instance,
and its peers book the same."""

from services.conductor.admission_policy import build_policy
from services.conductor.admitter import Admitter
from services.conductor.replicas import to_booking, to_message
from tests.unit.conductor.helpers import beat, cluster, config, request


def admitted(n: int):
    view, index, clock = cluster(beat("p1", "prefill"), beat("d1", "decode"))
    scheduler = Admitter(build_policy("cache_aware+predictive_rejection"), view, index, config())
    decision = scheduler.admit(request("r", num_sequences=n))
    assert decision.admitted, decision.error_message
    return scheduler, view, decision


def test_n_sequences_are_n_members_of_the_batch_and_slow_its_predicted_step():
    _, view_1, one = admitted(1)
    _, view_4, four = admitted(4)
    assert four.predicted_tbt_s > one.predicted_tbt_s
    load_1, load_4 = view_1.get("d1").decode, view_4.get("d1").decode
    assert load_1.total(0.0, 0.01)[0] == 1 and load_4.total(0.0, 0.01)[0] == 4
    assert load_4.total(0.0, 0.01)[1] == 4 * load_1.total(0.0, 0.01)[1]  # each sequence attends to the prompt
    load_4.started("r", 1.0)
    assert load_4.current(1.0, 0.01)[0] == 4 and load_4.num_decoding == 4
    assert load_4.forecast(1.0, 1.0, 0.01)[0] == 4
    load_4.done("r")
    assert load_4.total(2.0, 0.01) == (0, 0) and load_4.current(2.0, 0.01) == (0, 0)


def test_a_peer_replica_books_the_same_n():
    scheduler, _, _ = admitted(3)
    message = to_message(scheduler.admitted["r"].booking, "conductor-0")
    assert message.num_sequences == 3 and to_booking(message).num_sequences == 3
