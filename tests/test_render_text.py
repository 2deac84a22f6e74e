"""``render.text.wrap_parts``: header parts joined into lines that fit, never a line of the mark alone."""
from trainmem.render.text import wrap_parts


def test_wrap_parts_never_leaves_the_separator_mark_alone():
    # parts sized so that a line fills the width exactly before the break's mark is added
    for n, k in ((n, k) for n in range(1, 40) for k in range(4)):
        parts = ["x" * n, "y" * (97 - n - k), "z" * 10, "w" * 50, "v" * 30]
        lines = wrap_parts(parts, width=100)
        assert all(len(ln) <= 100 for ln in lines), lines
        assert all(ln.strip() not in ("·", "") for ln in lines), lines
        assert "".join(ln.strip().rstrip("·").replace(" · ", "").replace(" ", "") for ln in lines) == "".join(parts)
