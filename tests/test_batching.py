"""Continuous batching: batch invariance, requests joining and leaving, chunked prefill."""

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
MIXED = ["def f(x):", "import collections\n", "a", "class Queue(object):\n    def put(self, item):",
         "# " + "the quick brown fox " * 6, "print(", "return self._data[key]", "x = [i * i for i in"]


def test_each_prompt_alone_equals_inside_a_batch_of_8(shipped_llm):
    alone = [shipped_llm.generate([p], GREEDY)[0].token_ids for p in MIXED]
    together = [o.token_ids for o in shipped_llm.generate(MIXED, GREEDY)]
    assert alone == together


def test_requests_join_and_leave_the_running_batch(random_ckpt):
    llm = LLM(random_ckpt, max_num_seqs=2)
    lengths = [3, 9, 2, 5]
    for i, n in enumerate(lengths):
        llm.add_request([10 + i, 20, 30], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    running_sets, finished = [], []
    while llm.scheduler.has_work():
        finished += [o.request_id for o in llm.step()]
        running_sets.append(tuple(r.request_id for r in llm.scheduler.running))
    assert finished == ["req-0", "req-2", "req-3", "req-1"]
    # req-2 joins as soon as req-0 leaves, while req-1 keeps running.
    assert ("req-1", "req-2") in running_sets and ("req-1", "req-3") in running_sets
    assert max(len(s) for s in running_sets) == 2


def test_chunked_prefill_equals_one_pass(random_ckpt, random_llm):
    prompt = list(range(200, 290))
    chunked = LLM(random_ckpt, max_prefill_tokens=16)
    a = chunked.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3))[0]
    b = random_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3))[0]
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-5 for k in x)
    chunked.pool.check_integrity()
    assert chunked.pool.num_free == chunked.pool.num_pages
