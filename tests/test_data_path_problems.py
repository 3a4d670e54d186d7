"""The one data-path check (``data.blend.data_path_problems``) that start-up validation and ``--sft`` share."""

from __future__ import annotations

from megatron_wlb.data.blend import data_path_problems


def test_each_given_path_is_checked_and_a_bad_blend_is_named():
    seen: list[tuple[str, str]] = []

    def problem_of(option: str, path: str) -> str | None:
        seen.append((option, path))
        return f"--{option} {path}: missing" if path.startswith("gone") else None

    problems = data_path_problems(
        [("data_path", "0.7 here 0.3 gone_a"), ("train_data_path", None), ("valid_data_path", ["gone_b"]),
         ("test_data_path", "0.5 x 0.5")], problem_of)
    assert seen == [("data_path", "here"), ("data_path", "gone_a"), ("valid_data_path", "gone_b")]
    assert problems[:2] == ["--data_path gone_a: missing", "--valid_data_path gone_b: missing"]
    assert len(problems) == 3 and "odd number" in problems[2]  # the unparsable blend: its own one-line error
