"""Tests of sae_env.tokenizer: the simple and Hugging Face tokenizers, and ChatML rendering with token types."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sae_env import data
from sae_env.inputs import open_text
from sae_env.tokenizer import (
    QWEN_DEFAULT_SYSTEM,
    SPECIAL_TOKENS,
    ChatTemplate,
    HFTokenizer,
    SimpleTokenizer,
    get_tokenizer,
    split_reasoning,
)
from sae_env.trace import TokenType

T = TokenType


@pytest.fixture(scope="module")
def taubench():
    with open_text(data.TAUBENCH) as f:
        trajs = json.load(f)
    with open_text(data.TAUBENCH_TOOLS) as f:
        tools = json.load(f)
    return trajs, tools


# ----------------------------------------------------------------------------------------------------------------
# SimpleTokenizer

# The regex of the module, written the plain (unfactored, backtracking) way: the reference for the fast one.
_A = "A-Za-z\u00c0-\u024f\u0370-\u03ff\u0400-\u052f\u0590-\u05ff\u0600-\u06ff"
_REFERENCE_RE = re.compile(rf" ?[{_A}]{{1,6}}(?![{_A}])| ?[{_A}]{{1,4}}|[^\W\d_]{{1,2}}| ?\d{{1,3}}"
                           r"| ?(?:[^\w\s]|_){1,3}|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_simple_pinned_pieces_and_ids():
    tok = SimpleTokenizer()
    text = "Hello, world! Internationalization costs $1234.5"
    assert tok.pieces(text) == ["Hello", ",", " world", "!", " Inte", "rnat", "iona", "liza", "tion", " costs", " $",
                                "123", "4", ".", "5"]
    ids = tok.encode(text)
    assert ids == [108447, 145610, 105391, 31110, 134852, 108369, 42977, 150956, 150075, 136682, 90152, 124011,
                   47799, 138058, 84326]
    assert ids == [zlib.crc32(p.encode()) % 151_643 for p in tok.pieces(text)]
    assert tok.pieces("a  b\n\n  c 你好世界，Привет") == ["a", " ", " b", "\n\n", " ", " c", " ", "你好", "世界", "，",
                                                          "Привет"]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_simple_pieces_are_lossless_and_match_reference(text):
    tok = SimpleTokenizer(vocab_size=1000)
    pieces = tok.pieces(text)
    assert "".join(pieces) == text
    assert pieces == _REFERENCE_RE.findall(text)
    ids = tok.encode(text)
    assert len(ids) == len(pieces)
    assert all(0 <= i < 1000 for i in ids)
    assert tok.encode(text) == ids  # cached path gives the same


def test_simple_reference_regex_on_real_text(taubench):
    trajs, _ = taubench
    tok = SimpleTokenizer()
    for m in trajs[3]["traj"]:
        if m["content"]:
            assert tok.pieces(m["content"]) == _REFERENCE_RE.findall(m["content"])


def test_simple_about_four_characters_per_token(taubench):
    trajs, tools = taubench
    tok = SimpleTokenizer()
    policy = trajs[0]["traj"][0]["content"]
    assert len(policy) == 6155
    n = len(tok.encode(policy))
    assert n == 1526  # pinned; ~4.0 characters a token on English prose
    assert 3.5 < len(policy) / n < 4.5
    schemas = "".join("\n" + json.dumps(t) for t in tools)
    assert 2.5 < len(schemas) / len(tok.encode(schemas)) < 4.0  # JSON is denser, as with real BPE


def test_simple_ids_stable_across_processes():
    code = "from sae_env.tokenizer import SimpleTokenizer; print(SimpleTokenizer().encode('stable ids, please!'))"
    out = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert out[0] == out[1] == str(SimpleTokenizer().encode("stable ids, please!")) + "\n"


def test_special_tokens_reserved():
    tok = SimpleTokenizer()
    ids = [tok.special_id(s) for s in SPECIAL_TOKENS]
    assert ids == list(SPECIAL_TOKENS.values())
    assert tok.special_id("<|im_start|>") == 151644 and tok.special_id("<|im_end|>") == 151645
    assert len(set(ids)) == len(ids) and min(ids) >= tok.vocab_size
    with pytest.raises(ValueError, match="unknown special token"):
        tok.special_id("<|nope|>")
    with pytest.raises(ValueError, match="vocab_size"):
        SimpleTokenizer(vocab_size=200_000)


def test_get_tokenizer_specs(tmp_path):
    assert isinstance(get_tokenizer(None), SimpleTokenizer)
    assert get_tokenizer("simple") is get_tokenizer(None)
    custom = SimpleTokenizer(vocab_size=50)
    assert get_tokenizer(custom) is custom
    with pytest.raises(ValueError, match="unknown tokenizer spec"):
        get_tokenizer(tmp_path / "missing.json")
    with pytest.raises(TypeError):
        get_tokenizer(3.5)


# ----------------------------------------------------------------------------------------------------------------
# HFTokenizer (a tiny tokenizer.json built here with the tokenizers library itself; no download)

SENTENCES = ["the customer wants to book a flight", "the agent asks for the user id", "book the flight to seattle",
             "cancel my reservation please", "what is the baggage allowance"]


@pytest.fixture(scope="module")
def hf_files(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("hf")
    wl = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    wl.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>",
                                                                                "<|im_end|>"]))
    (folder / "wordlevel").mkdir()
    wl.save(str(folder / "wordlevel" / "tokenizer.json"))
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(SENTENCES * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(folder / "bpe.json"))
    return folder, wl, bpe


def test_hf_tokenizer_matches_the_library(hf_files):
    folder, wl, bpe = hf_files
    tok = get_tokenizer(folder / "wordlevel" / "tokenizer.json")
    assert isinstance(tok, HFTokenizer)
    assert get_tokenizer(folder / "wordlevel").name == tok.name  # a folder holding tokenizer.json
    text = "the agent asks to book a flight to boston"
    assert tok.encode(text) == wl.encode(text, add_special_tokens=False).ids
    assert tok.special_id("<|im_start|>") == wl.token_to_id("<|im_start|>")
    assert tok.special_id("<|im_end|>") == wl.token_to_id("<|im_end|>")
    reserved = [tok.special_id(s) for s in SPECIAL_TOKENS if wl.token_to_id(s) is None]
    assert reserved == list(range(tok.vocab_size, tok.vocab_size + len(reserved)))

    btok = HFTokenizer(folder / "bpe.json")
    assert btok.encode("book a flight, please") == bpe.encode("book a flight, please").ids
    assert btok.special_id("<|endoftext|>") == bpe.token_to_id("<|endoftext|>")


def test_hf_tokenizer_renders_chat_with_prefix_property(hf_files):
    folder, _, _ = hf_files
    ct = ChatTemplate(folder / "bpe.json")
    msgs = [{"role": "system", "content": "the agent"}, {"role": "user", "content": "book a flight"},
            {"role": "assistant", "content": "the user id please"}, {"role": "user", "content": "seattle"},
            {"role": "assistant", "content": "done"}]
    p1, _ = ct.render(msgs[:2], add_generation_prompt=True)
    o1, _ = ct.render_output(msgs[2])
    p2, _ = ct.render(msgs[:4], add_generation_prompt=True)
    assert np.array_equal(p2[:p1.size + o1.size], np.concatenate([p1, o1]))


def test_hf_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such tokenizer file"):
        HFTokenizer(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable"):
        HFTokenizer(bad)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match="optional 'tokenizers' package"):
        HFTokenizer(bad)


# ----------------------------------------------------------------------------------------------------------------
# The template's text equals Qwen2.5's own Jinja chat template

QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501 - Qwen2.5-Instruct's chat_template, verbatim


@pytest.fixture(scope="module")
def qwen_jinja():
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # as transformers sets it up: trim_blocks, lstrip_blocks, and a tojson that is json.dumps(ensure_ascii=False)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
    template = env.from_string(QWEN25_TEMPLATE)

    def render(messages, tools=None, add_generation_prompt=False):
        msgs = []
        for m in messages:  # vLLM parses JSON-string arguments before templating; so does our template
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                                 "arguments": json.loads(c["function"]["arguments"])
                                                 if isinstance(c["function"]["arguments"], str)
                                                 else c["function"]["arguments"]}} for c in m["tool_calls"]]
            msgs.append(m)
        return template.render(messages=msgs, tools=tools, add_generation_prompt=add_generation_prompt)

    return render


def test_text_equals_qwen25_jinja_on_taubench(taubench, qwen_jinja):
    trajs, tools = taubench
    ct = ChatTemplate(default_system=QWEN_DEFAULT_SYSTEM)
    for s in range(0, 200, 9):
        msgs = trajs[s]["traj"]
        j = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        assert ct.render_text(msgs, tools) == qwen_jinja(msgs, tools)
        assert ct.render_text(msgs[:j], tools, True) == qwen_jinja(msgs[:j], tools, True)


_PLAIN = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="<"),
                 max_size=25)
_NAME = st.text(alphabet="abcdefgh_", min_size=1, max_size=8)
_ARGS = st.dictionaries(_NAME, st.one_of(st.integers(-5, 5), _PLAIN, st.booleans()), max_size=3)


@st.composite
def conversations(draw, reasoning: bool = True, tool_calls: bool = True, free_order: bool = True):
    """Random conversations: user turns, each followed by one or more assistant steps (with tool calls and their
    results), optional system messages, and (free_order) arbitrary role sequences."""
    msgs: list[dict] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_PLAIN)})

    def assistant() -> dict:
        m: dict = {"role": "assistant", "content": draw(_PLAIN)}
        if tool_calls and draw(st.integers(0, 2)) == 0:
            m["tool_calls"] = [{"function": {"name": draw(_NAME), "arguments": draw(st.one_of(
                _ARGS, _ARGS.map(json.dumps)))}} for _ in range(draw(st.integers(1, 2)))]
            if not m["content"] and draw(st.booleans()):
                m["content"] = None
        if reasoning and draw(st.integers(0, 2)) == 0:
            r = draw(_PLAIN)
            if draw(st.booleans()):
                m["reasoning_content"] = r
            elif m["content"] is not None:
                m["content"] = f"<think>\n{r}\n</think>\n\n{m['content']}"
        return m

    if free_order and draw(st.integers(0, 3)) == 0:
        for role in draw(st.lists(st.sampled_from(["system", "user", "assistant", "tool"]), max_size=8)):
            msgs.append(assistant() if role == "assistant" else {"role": role, "content": draw(_PLAIN)})
        return msgs
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(_PLAIN)})
        for _ in range(draw(st.integers(1, 3))):
            a = assistant()
            msgs.append(a)
            for _ in a.get("tool_calls", ()):
                msgs.append({"role": "tool", "content": draw(_PLAIN)})
    return msgs


_TOOLS = st.one_of(st.none(), st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                                                               st.fixed_dictionaries({"name": _NAME})}),
                                       min_size=1, max_size=2))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(reasoning=False, free_order=False), _TOOLS, st.booleans())
def test_text_equals_qwen25_jinja_random(qwen_jinja, msgs, tools, gen):
    ct = ChatTemplate(default_system=QWEN_DEFAULT_SYSTEM)
    assert ct.render_text(msgs, tools, gen) == qwen_jinja(msgs, tools, gen)


def test_no_default_system_unless_asked():
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatTemplate().render_text(msgs, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate(default_system="S").render_text(msgs) == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


# ----------------------------------------------------------------------------------------------------------------
# Token types, exactly from roles: checked with a one-token-per-character tokenizer against a parser of the text


_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))


class CharTokenizer:
    """Test double: one token per character; special tokens (also inside text, as a Hugging Face tokenizer's added
    tokens are) get ids above Unicode."""

    name = "char"

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            out += [ord(c) for c in text[pos:m.start()]]
            out.append(self.special_id(m.group()))
            pos = m.end()
        return out + [ord(c) for c in text[pos:]]

    def special_id(self, token: str) -> int:
        return 0x110000 + list(SPECIAL_TOKENS).index(token)


def _reference_tokens_and_types(text: str, output: bool = False) -> tuple[list[int], list[int]]:
    """Tokenize ChatML text one character (or special token) at a time and label each token from the role of the
    block it sits in: the reference the renderer's types must equal."""
    char = CharTokenizer()
    units: list[tuple[int, int]] = []  # (token, start offset in text)
    pos = 0
    for m in _SPECIAL_RE.finditer(text):
        units += [(ord(c), pos + k) for k, c in enumerate(text[pos:m.start()])]
        units.append((char.special_id(m.group()), m.start()))
        pos = m.end()
    units += [(ord(c), pos + k) for k, c in enumerate(text[pos:])]
    label = np.full(len(text), -1)
    blocks = [(0, "assistant")] if output else []
    blocks += [(m.start(), text[m.end():].split("\n")[0][:4]) for m in re.finditer(re.escape("<|im_start|>"), text)]
    for n, (start, role) in enumerate(blocks):
        end = blocks[n + 1][0] if n + 1 < len(blocks) else len(text)
        chunk = text[start:end]
        if role == "syst":
            label[start:end] = T.SYSTEM
            if "\n\n# Tools\n\n" in chunk:
                a = start + chunk.index("\n\n# Tools\n\n")
                b = start + chunk.rindex("</tool_call>") + len("</tool_call>")
                label[a:b] = T.TEMPLATE
        elif role == "user":
            label[start:end] = T.TOOL_OUTPUT if "<tool_response>" in chunk else T.USER
        else:
            label[start:end] = T.ASSISTANT
            if "<think>" in chunk:
                a = start + chunk.index("<think>")
                b = start + chunk.index("</think>") + len("</think>\n\n")
                label[a:b] = T.REASONING
    assert (label >= 0).all()
    return [u for u, _ in units], [int(label[off]) for _, off in units]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), _TOOLS, st.one_of(st.none(), _PLAIN))
def test_types_exact_from_roles(msgs, tools, default_system):
    ct = ChatTemplate(CharTokenizer(), default_system=default_system)
    text = ct.render_text(msgs, tools, add_generation_prompt=True)
    tokens, types = ct.render(msgs, tools, add_generation_prompt=True)
    ref_tokens, ref_types = _reference_tokens_and_types(text)
    assert tokens.tolist() == ref_tokens
    assert types.tolist() == ref_types
    for m in msgs:
        if m["role"] == "assistant":
            out_text = "".join(s[0] for s in ct.output_segments(m))
            o_tokens, o_types = ct.render_output(m)
            ref_tokens, ref_types = _reference_tokens_and_types(out_text, output=True)
            assert o_tokens.tolist() == ref_tokens and o_types.tolist() == ref_types
            assert (T.REASONING in o_types) == (split_reasoning(m)[0] is not None)


def test_types_of_a_known_agent_turn():
    ct = ChatTemplate(CharTokenizer())
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "R1"}, {"role": "tool", "content": "R2"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    toks, types = ct.render(msgs, tools)
    text = ct.render_text(msgs, tools)
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
                         "<|im_start|>user\n<tool_response>\nR1\n</tool_response>\n<tool_response>\nR2\n"
                         "</tool_response><|im_end|>\n")
    counts = np.bincount(types, minlength=len(T))
    head = len("system\nS") + 1 + len("\n") + 1  # <|im_start|>, role line + content, <|im_end|>, newline
    assert counts[T.SYSTEM] == head
    assert counts[T.USER] == len("user\nU\n") + 2
    assert counts[T.TOOL_OUTPUT] == len("user") + 2 * len("\n\nRx\n") + 4 + 2 + 1  # 4 tags, im_start/end
    assert counts[T.TEMPLATE] == toks.size - counts[[T.SYSTEM, T.USER, T.ASSISTANT, T.TOOL_OUTPUT]].sum()


# ----------------------------------------------------------------------------------------------------------------
# The key property: prompt_k + output_k is a prefix of prompt_{k+1}, unless turn k reasons


def _calls(msgs):
    return [j for j, m in enumerate(msgs) if m["role"] == "assistant"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), _TOOLS)
def test_prefix_property(msgs, tools):
    ct = ChatTemplate()
    calls = _calls(msgs)
    gen, _ = ct.generation_prompt()
    for j, k in zip(calls, calls[1:], strict=False):
        p1, _ = ct.render(msgs[:j], tools, add_generation_prompt=True)
        o1, t1 = ct.render_output(msgs[j])
        p2, _ = ct.render(msgs[:k], tools, add_generation_prompt=True)
        assert np.array_equal(p1[-gen.size:], gen)
        seq = np.concatenate([p1, o1])
        if split_reasoning(msgs[j])[0] is None:
            assert np.array_equal(p2[:seq.size], seq)
        else:
            # generated reasoning is not in the next prompt: the sequences part exactly where the reasoning starts
            first_r = p1.size + int(np.flatnonzero(t1 == T.REASONING)[0])
            assert np.array_equal(p2[:first_r], seq[:first_r])
            assert p2.size <= first_r or p2[first_r] != seq[first_r]
            kept = {"role": "assistant", "content": split_reasoning(msgs[j])[1],
                    "tool_calls": msgs[j].get("tool_calls")}
            o_hist, _ = ct.render_output(kept)
            assert np.array_equal(p2[:p1.size + o_hist.size], np.concatenate([p1, o_hist]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), _TOOLS)
def test_conversation_matches_render(msgs, tools):
    """The one-pass rendering used by the sources equals rendering each prompt and output on its own."""
    ct = ChatTemplate()
    r = ct.conversation(msgs, tools)
    gen, gen_t = ct.generation_prompt()
    assert sorted(r.outputs) == _calls(msgs)
    for j in _calls(msgs):
        p, pt = ct.render(msgs[:j], tools, add_generation_prompt=True)
        assert np.array_equal(np.concatenate([r.tokens[:r.ends[j]], gen]), p)
        assert np.array_equal(np.concatenate([r.types[:r.ends[j]], gen_t]), pt)
        o, ot = ct.render_output(msgs[j])
        assert np.array_equal(r.outputs[j][0], o) and np.array_equal(r.outputs[j][1], ot)
    full, full_t = ct.render(msgs, tools)
    assert np.array_equal(r.tokens, full) and np.array_equal(r.types, full_t)


def test_reasoning_rendering():
    ct = ChatTemplate(CharTokenizer())
    m = {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nAnswer"}
    assert split_reasoning(m) == ("hmm", "Answer")
    assert "".join(s[0] for s in ct.output_segments(m)) == "<think>\nhmm\n</think>\n\nAnswer<|im_end|>\n"
    hist = ct.render_text([{"role": "user", "content": "q"}, m])
    assert hist == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nAnswer<|im_end|>\n"
    field = {"role": "assistant", "content": "Answer", "reasoning_content": "\nhmm\n"}
    assert ct.render_output(field)[0].tolist() == ct.render_output(m)[0].tolist()
    assert split_reasoning({"role": "assistant", "content": "<think>\n\n</think>\n\nHi"}) == (None, "Hi")
    assert split_reasoning({"role": "assistant", "content": "no tags", "reasoning": "r"}) == ("r", "no tags")


def test_tool_call_arguments():
    ct = ChatTemplate(CharTokenizer())

    def text(args):
        return "".join(s[0] for s in ct.output_segments(
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": args}}]}))

    assert text('{"a":1,"b":"é"}') == text({"a": 1, "b": "é"}) == \
        '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "é"}}\n</tool_call><|im_end|>\n'
    assert text("not json") == '<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call><|im_end|>\n'


def test_unknown_role():
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        ChatTemplate().render([{"role": "robot", "content": "x"}])
