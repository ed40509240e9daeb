from skulkp2p.engine.decode.text import TextAssembler


class CharTokenizer:
    """Each token id is one byte; decoding is UTF-8 with replacement, as real tokenizers do."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(text: str, stops=()):
    asm = TextAssembler(CharTokenizer(), tuple(stops))
    deltas = []
    for b in text.encode():
        deltas.append(asm.add(b))
        if asm.stopped:
            break
    deltas.append(asm.finish())
    return asm, deltas


def test_no_stop_releases_everything():
    asm, deltas = feed("hello world")
    assert "".join(deltas) == "hello world" == asm.text


def test_stop_cut_inside_and_across_tokens():
    asm, deltas = feed("abc STOP def", ["STOP"])
    assert asm.stopped and asm.text == "abc " and "".join(deltas) == "abc "


def test_partial_stop_is_held_back_then_released():
    asm = TextAssembler(CharTokenizer(), ("END",))
    out = [asm.add(b) for b in b"xEN"]
    assert "".join(out) == "x"  # "EN" might become END
    out.append(asm.add(ord("d")))
    assert "".join(out) == "xENd" and not asm.stopped


def test_incomplete_utf8_held_back():
    asm = TextAssembler(CharTokenizer())
    euro = "€".encode()
    assert asm.add(euro[0]) == "" and asm.add(euro[1]) == ""
    assert asm.add(euro[2]) == "€"


def test_earliest_of_several_stops():
    asm, _ = feed("one two three", ["three", "two"])
    assert asm.text == "one "
