r"""User patterns follow ECMA-262 (issue #20): ``\d{3}-\d{4}`` writes ASCII digits only.

The translator's text, its meaning once llguidance compiles it (on the tiny tokenizer),
JSON Schema patterns wherever they sit, and the tiny model under guides.
"""

from __future__ import annotations

import copy
import json
import re

import pytest

from ninfer import LLM, SamplingParams
from ninfer.errors import InvalidRequestError
from ninfer.guided.ecma_regex import ANY, DOT, SPACE, PatternError, ecma_to_rust
from ninfer.guided.schema_patterns import schema_with_rust_patterns
from ninfer.guided.spec import GuideSpec
from ninfer_plugins.guided import llguidance_backend
from ninfer_plugins.guided.llguidance_grammar import SpecialTokens, grammar_for

#: ECMA-262 WhiteSpace and LineTerminator, as Python text
ECMA_SPACE = "\t\n\v\f\r \u00a0\ufeff\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + \
             "\u2028\u2029\u202f\u205f\u3000"
#: white space to Unicode (and so to Rust's \s) but not to ECMA
NOT_ECMA_SPACE = "\u0085"


# -- the rewritten text ------------------------------------------------------------------------
@pytest.mark.parametrize("ecma, rust", [
    (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
    (r"\D", "[^0-9]"),
    (r"\w+", "[0-9A-Za-z_]+"),
    (r"\W", "[^0-9A-Za-z_]"),
    (r"\s", f"[{SPACE}]"),
    (r"\S", f"[^{SPACE}]"),
    # inside a class a positive shorthand joins it; a negated one nests (Rust: union)
    (r"[\d.]", "[0-9.]"),
    (r"[^\s]", f"[^{SPACE}]"),
    (r"[^\d\s]", f"[^0-9{SPACE}]"),
    (r"[\W_]", "[[^0-9A-Za-z_]_]"),
    (r"[^\D]", "[^[^0-9]]"),
    # escapes: an escaped backslash is a literal; other escapes pass through
    (r"\\d", r"\\d"),
    (r"\\\d", r"\\[0-9]"),
    (r"[\\\d]", r"[\\0-9]"),
    (r"\.\$\(\)\[\]\{\}", r"\.\$\(\)\[\]\{\}"),
    (r"\x41\u0042\t\n\p{Lu}\P{L}", r"\x41\u0042\t\n\p{Lu}\P{L}"),
    (r"[\x41-\x5A\u0061-\u007A]", r"[\x41-\x5A\u0061-\u007A]"),
    (r"[\p{Lu}\d]", r"[\p{Lu}0-9]"),
    (r"[\]\d]", r"[\]0-9]"),
    # a dash next to a shorthand is a literal (ECMA Annex B); Rust would read a range
    (r"[\w-.]", r"[0-9A-Za-z_\-.]"),
    (r"[a-\d]", r"[a\-0-9]"),
    (r"[\p{L}-]", r"[\p{L}\-]"),
    (r"[a-z-]", r"[a-z\-]"),
    (r"[-a]", r"[\-a]"),
    (r"[a-b-c]", r"[a-b\-c]"),
    (r"[--/]", r"[\--/]"),
    # ECMA reads these literally inside a class; Rust gives them a meaning
    ("[[]", r"[\[]"),
    ("[a&&b~~c]", r"[a\&\&b\~\~c]"),
    ("[a^]", r"[a\^]"),
    (r"[\b]", r"[\x{8}]"),
    # ECMA's first "]" always closes: [] matches nothing, [^] any character
    ("x[]", f"x[^{ANY}]"),
    ("[^]*", f"[{ANY}]*"),
    ("[]a]", f"[^{ANY}]a]"),
    # ECMA's dot stops at every line terminator; inside a class it is a plain dot
    ("a.b", f"a{DOT}b"),
    (r"\.[.]", r"\.[.]"),
    # everything else is untouched
    ("(?:ab|c)+?$", "(?:ab|c)+?$"),
    ("^[a-z]{2,5}(x|y)*é$", "^[a-z]{2,5}(x|y)*é$"),
    ("a]", "a]"),
    ("", ""),
])
def test_shorthands_are_spelled_out_and_the_rest_is_kept(ecma, rust):
    assert ecma_to_rust(ecma) == rust


@pytest.mark.parametrize("pattern, fragment", [
    ("[a-z", "never closed"),
    (r"x[\d", "never closed"),
    ("ab\\", "lone backslash"),
    (r"[\p{L]", "never closed"),
])
def test_malformed_patterns_are_refused(pattern, fragment):
    with pytest.raises(PatternError, match=fragment):
        ecma_to_rust(pattern)


# -- what llguidance then accepts ----------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(tok):
    return llguidance_backend.LLGuidanceCompiler(tok, tok.vocab_size)


def accepts(compiler, spec: GuideSpec, text: str) -> bool:
    m = compiler.matcher(spec)
    return all(m.consume_token(t) for t in compiler.tokenizer.tokenize_str(text)) and m.is_accepting()


@pytest.mark.parametrize("pattern, good, bad", [
    (r"\d{3}-\d{4}", ["555-1234"], ["٥٥٥-١٢٣٤", "555-12३4", "555-1２34"]),
    (r"\w+", ["snake_Case9"], ["é", "ß", "a-b"]),
    (r"\s", list(ECMA_SPACE), [NOT_ECMA_SPACE, "\u180e", "a"]),
    (r"\S+", ["abc", NOT_ECMA_SPACE], ["\ufeff", "a b"]),
    (r"\D\W", ["٣é", "a-"], ["3-", "aa", "a_"]),
    (r"[\d.]+", ["3.14"], ["٣"]),
    (r"[^\s]+", ["a" + NOT_ECMA_SPACE], ["a\u00a0"]),
    (r"[^\D]", ["7"], ["٧", "a"]),
    (r"[\W_]", ["_", "-", "é"], ["a", "5"]),
    (r"[^\W_]", ["a", "5"], ["_", "é"]),
    (r"[\s\d]", [" ", "\u3000", "0"], ["٠", NOT_ECMA_SPACE]),
    (r"[\w-.]+", ["a-b.c_9"], ["a/b"]),
    (r"\\d", ["\\d"], ["5", "d"]),
    (r"[\\\d]", ["\\", "5"], ["d"]),
    ("[a&&b]", ["&", "a", "b"], ["c"]),
    ("[[]", ["["], ["]"]),
    ("x|a[]", ["x"], ["a"]),
    ("[^]", ["\n", "é"], ["ab"]),
    (r"\p{Lu}", ["É"], ["é"]),
    ("a.c", ["abc", "a\u00e9c", "a\tc"], ["a\nc", "a\rc", "a\u2028c"]),
])
def test_compiled_regex_guides_read_patterns_as_ecma_does(compiler, pattern, good, bad):
    spec = GuideSpec("regex", pattern)
    for text in good:
        assert accepts(compiler, spec, text), (pattern, text)
    for text in bad:
        assert not accepts(compiler, spec, text), (pattern, text)


def test_json_schema_patterns_use_ecma_white_space(compiler):
    # llguidance itself already reads \d and \w in schemas as ASCII, but not \s
    string = GuideSpec("json_schema", {"type": "string", "pattern": r"^\d\s$"})
    assert accepts(compiler, string, '"1\ufeff"') and accepts(compiler, string, '"1\u00a0"')
    assert not accepts(compiler, string, f'"1{NOT_ECMA_SPACE}"')
    assert not accepts(compiler, string, '"١ "')
    keyed = GuideSpec("json_schema", {"type": "object", "patternProperties": {r"^x\s$": {"type": "integer"}},
                                      "additionalProperties": False})
    assert accepts(compiler, keyed, '{"x\ufeff": 1}')
    assert not accepts(compiler, keyed, f'{{"x{NOT_ECMA_SPACE}": 1}}')


def test_structural_tag_schemas_get_the_rewrite_too():
    tag = {"triggers": ["<t>"], "structures": [{"begin": "<t>", "end": "</t>",
                                                 "schema": {"type": "string", "pattern": r"^\s$"}}]}
    grammar = grammar_for(GuideSpec("structural_tag", tag), SpecialTokens({}))
    assert json.dumps(f"^[{SPACE}]$") in grammar and r'"^\\s$"' not in grammar


def test_bad_patterns_are_400s_naming_the_field(compiler):
    with pytest.raises(InvalidRequestError) as err:
        compiler.matcher(GuideSpec("regex", r"[\d", param="guided_regex"))
    assert err.value.param == "guided_regex" and "invalid regex" in err.value.message
    schema = {"type": "object", "properties": {"a/b": {"type": "string", "pattern": "[x"}}}
    with pytest.raises(InvalidRequestError) as err:
        compiler.matcher(GuideSpec("json_schema", schema, param="response_format.json_schema.schema"))
    assert err.value.param == "response_format.json_schema.schema"
    assert "/properties/a~1b/pattern" in err.value.message and "never closed" in err.value.message
    tag = {"triggers": ["<t>"], "structures": [{"begin": "<t>", "end": "</t>", "schema": {"pattern": "\\"}}]}
    with pytest.raises(InvalidRequestError) as err:
        compiler.matcher(GuideSpec("structural_tag", tag, param="st"))
    assert err.value.param == "st.structures[0].schema" and "lone backslash" in err.value.message


# -- JSON Schema: every pattern, and nothing else ---------------------------------------------------
def test_every_schema_pattern_is_rewritten_and_data_is_not():
    d = r"\d"
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "pattern": d},
            "pattern": {"type": "string", "pattern": d},  # a property that happens to be named so
            "list": {"type": "array", "items": {"pattern": d}, "contains": {"pattern": d}},
            "tuple": {"prefixItems": [{"pattern": d}], "items": [{"pattern": d}], "additionalItems": {"pattern": d}},
            "nested": {"properties": {"deep": {"anyOf": [{"type": "null"}, {"pattern": d}]}}},
            "data": {"const": {"pattern": d}, "enum": [{"pattern": d}], "default": {"pattern": d},
                     "examples": [{"pattern": d}]},
        },
        "patternProperties": {d: {"pattern": d}},
        "propertyNames": {"pattern": d},
        "additionalProperties": {"oneOf": [{"pattern": d}, {"allOf": [{"pattern": d}]}]},
        "dependentSchemas": {"a": {"not": {"pattern": d}}},
        "dependencies": {"a": ["b"], "b": {"pattern": d}},
        "if": {"pattern": d}, "then": {"pattern": d}, "else": {"pattern": d},
        "$defs": {"x": {"pattern": d}}, "definitions": {"y": {"pattern": d}},
        "x-guidance": {"whitespace_pattern": d},  # llguidance's own option: Rust syntax already
    }
    before = copy.deepcopy(schema)
    out = schema_with_rust_patterns(schema)
    assert schema == before  # the caller's schema is untouched

    rewritten = json.dumps(out).replace(json.dumps(d)[1:-1], "<D>")
    assert rewritten.count("<D>") == 5  # the four data values and x-guidance, nothing else
    assert out["properties"]["data"] == schema["properties"]["data"]
    assert out["x-guidance"] == schema["x-guidance"]
    assert out["properties"]["pattern"]["pattern"] == "[0-9]"
    assert out["properties"]["nested"]["properties"]["deep"]["anyOf"][1] == {"pattern": "[0-9]"}
    assert out["patternProperties"] == {"[0-9]": {"pattern": "[0-9]"}}
    assert out["dependencies"]["a"] == ["b"] and out["$defs"]["x"]["pattern"] == "[0-9]"
    assert out["additionalProperties"]["oneOf"][1]["allOf"][0]["pattern"] == "[0-9]"


def test_pattern_property_names_that_become_equal_keep_both_schemas():
    out = schema_with_rust_patterns({"patternProperties": {r"\d": {"minLength": 1}, "[0-9]": {"maxLength": 3}}})
    assert out == {"patternProperties": {"[0-9]": {"allOf": [{"minLength": 1}, {"maxLength": 3}]}}}


def test_boolean_and_odd_schemas_pass_through():
    assert schema_with_rust_patterns(True) is True
    assert schema_with_rust_patterns({"pattern": 5, "items": False}) == {"pattern": 5, "items": False}


# -- the tiny model under guides --------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(str(tiny_qwen3), device="cpu", dtype="fp32", max_context=128, max_concurrency=8)


def toward(tok, wanted) -> dict[int, float]:
    """A logit bias raising every token whose bytes ``wanted`` accepts."""
    return {t: 8.0 for t in range(tok.vocab_size) if tok.token_bytes(t) and wanted(tok.token_bytes(t))}


def test_the_reported_phone_pattern_writes_ascii_digits(llm):
    # non-ASCII tokens pushed up: a Unicode digit would win wherever the guide allowed one
    bias = toward(llm.get_tokenizer(), lambda b: max(b) >= 0x80)
    spec = GuideSpec("regex", r"\d{3}-\d{4}")
    params = [SamplingParams(guided=spec, temperature=1.0, seed=s, max_tokens=24, logit_bias=bias) for s in range(6)]
    for out in llm.generate(["Call me at"] * 6, params, thinking=False):
        c = out.outputs[0]
        assert re.fullmatch("[0-9]{3}-[0-9]{4}", c.text), c.text
        assert c.finish_reason == "stop"


def test_a_schema_pattern_with_white_space_writes_ecma_white_space(llm):
    # pushed toward U+0085 (bytes C2 85): Unicode white space, but not ECMA's
    bias = toward(llm.get_tokenizer(), lambda b: b.strip(b" ") in (b"\xc2", b"\x85"))
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": r"^\d{2}\s\w$"}},
              "required": ["code"], "additionalProperties": False}
    spec = GuideSpec("json_schema", schema)
    params = [SamplingParams(guided=spec, temperature=1.0, seed=s, max_tokens=40, logit_bias=bias) for s in range(6)]
    for out in llm.generate(["Code:"] * 6, params, thinking=False):
        code = json.loads(out.outputs[0].text)["code"]
        assert re.fullmatch(f"[0-9]{{2}}[{ECMA_SPACE}][0-9A-Za-z_]", code), ascii(code)
