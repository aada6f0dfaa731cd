"""Chat template (against transformers' rendering) and stop conditions."""

from transformers import AutoTokenizer

from engine import SamplingParams
from models import copy_eval

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Repeat after me: tandem-42"}]


def test_chat_template_matches_transformers(shipped_llm):
    hf = AutoTokenizer.from_pretrained(shipped_llm.config.model)
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    got = shipped_llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert got == want and got.endswith("<|im_start|>assistant\n")
    assert shipped_llm.tokenizer.encode(got) == hf(want, add_special_tokens=False)["input_ids"]


def test_shipped_model_repeats_canaries(shipped_llm):
    """The chaos suite plants canaries; the model card measures 54 of 60 exact copies."""
    canaries = copy_eval.canaries(10, seed=7)
    outs = shipped_llm.chat([[{"role": "user", "content": f"Repeat after me: {c}"}] for c in canaries],
                            SamplingParams(max_tokens=32, temperature=0))
    assert all(o.finish_reason == "stop" for o in outs)
    exact = [o.text.strip() == c for o, c in zip(outs, canaries)]
    assert sum(exact) >= 8, list(zip(canaries, [o.text for o in outs]))


def _free_run(llm, prompt, n=24):
    return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]


def test_stop_string_cuts_the_text(random_llm):
    prompt = [33, 34, 35]
    base = _free_run(random_llm, prompt)
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    out = random_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                       stop=[stop, "\x00never"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == base.text[:base.text.find(stop)]
    assert base.token_ids[:len(out.token_ids)] == out.token_ids


def test_stop_token_ids_and_eos(random_llm):
    prompt = [60, 61]
    base = _free_run(random_llm, prompt)
    target = base.token_ids[6]
    first = base.token_ids.index(target)
    out = random_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                       stop_token_ids=[target]))[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[:first + 1]
    assert out.text == random_llm.tokenizer.decode(base.token_ids[:first])
    length = random_llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 5


def test_eos_ends_generation_unless_ignored(random_llm):
    prompt = [60, 61]
    base = _free_run(random_llm, prompt)
    eos = base.token_ids[3]
    saved = random_llm.core.eos_ids          # read by each new request's stop checker
    random_llm.core.eos_ids = frozenset({eos})
    try:
        out = random_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
        ignored = random_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    finally:
        random_llm.core.eos_ids = saved
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos
    assert len(out.token_ids) == base.token_ids.index(eos) + 1
    assert ignored.token_ids == base.token_ids
