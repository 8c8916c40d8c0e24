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


def test_rotated_rounds_takes_the_contenders_in_turns_starting_one_later_each_round():
  seq, waited = [], []

  def contender(name):
    return (lambda: seq.append(name) or name), waited.append

  ms = timing.rotated_rounds({n: contender(n) for n in "abc"}, rounds=4, n=2)
  batches = ["".join(seq[i:i + 2]) for i in range(3, len(seq), 2)]  # after one warm-up call each
  assert seq[:3] == list("abc") and batches == ["aa", "bb", "cc", "bb", "cc", "aa", "cc", "aa", "bb", "aa", "bb", "cc"]
  assert waited == list("abc") + [b[0] for b in batches]  # each batch waits once, on its own last call
  assert list(ms) == list("abc") and all(len(v) == 4 for v in ms.values())


def test_rate_ratios_pairs_each_round_with_the_base_s_same_round():
  # ratios round by round (10/8, 20/16, 10/12.5); the ratio of the medians (10/12.5) would say 0.8
  ms = {"base": [10.0, 20.0, 10.0], "x": [8.0, 16.0, 12.5]}
  r = timing.rate_ratios(ms, "base")["x"]
  assert r == dict(median=1.25, low=0.8, high=1.25, faster_rounds=2, rounds=3)


def test_head_to_head_keeps_a_failed_case_as_an_error():
  # a case whose contenders cannot all be timed in turns (one not measured there, or out of memory together) is an
  # error record, and the benchmark goes on to its next case
  def oom():
    raise MemoryError("all operands at once")

  ok = (lambda: 1, lambda _: None)
  assert timing.head_to_head({"torch": ok}, ["torch", "ring"], 2)["error"].startswith("not measured here")
  assert timing.head_to_head({"torch": ok, "ring": (oom, lambda _: None)}, ["torch", "ring"], 2)["error"] == (
      "MemoryError: all operands at once")
  done = timing.head_to_head({"torch": ok, "ring": ok, "other": ok}, ["torch", "ring"], 3)
  assert list(done["rounds_ms"]) == ["torch", "ring"] and done["rate_vs_base"]["ring"]["rounds"] == 3
