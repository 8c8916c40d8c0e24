"""experiments.timing.pipelined issues its calls back to back and waits once per batch, on the batch's last result
(counted, not timed: tests never time)."""

from experiments import timing


def test_pipelined_waits_once_per_batch_on_its_last_call():
  calls, waited = [], []

  def call():
    calls.append(len(calls))
    return calls[-1]

  ms = timing.pipelined(call, waited.append, n=4, reps=3)
  assert len(calls) == 1 + 4 * 3  # one warm-up call, then 3 batches of 4
  assert waited == [0, 4, 8, 12]  # the warm-up, then each batch's last call only
  assert ms >= 0
