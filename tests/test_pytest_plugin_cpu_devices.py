"""`--cpu-devices N` takes a count of 1 to 1024 CPU devices, spelled in ASCII digits;
anything else stops the session with a usage error naming the option, before JAX starts."""

import pytest

pytest_plugins = ["pytester"]

BAD_COUNTS = ["0", "-1", "1025", "100000", str(10**8), "1.5", "+1", " 1", "1_0", "١", "²", "a"]


@pytest.mark.parametrize("count", BAD_COUNTS)
def test_a_count_outside_1_to_1024_digits_is_a_usage_error_naming_the_option(pytester, count):
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "eqx_train.testing", f"--cpu-devices={count}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--cpu-devices*from 1 to 1024*"])


def test_the_usage_error_comes_before_jax_is_asked(pytester, monkeypatch):
    """A bound checked after `jax_num_cpu_devices` is set would be too late: the update
    is never made for a refused count."""
    import jax

    updates = []
    monkeypatch.setattr(jax.config, "update", lambda *args: updates.append(args))
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "eqx_train.testing", "--cpu-devices", "4096")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert updates == []


def test_a_count_of_thousands_of_digits_is_a_usage_error_quoting_it_shortened(pytester):
    """Python's `int()` refuses more than 4300 digits with a bare ValueError."""
    pytester.makepyfile("def test_nothing():\n    pass\n")
    count = "9" * 5000
    result = pytester.runpytest_inprocess("-p", "eqx_train.testing", f"--cpu-devices={count}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--cpu-devices*from 1 to 1024*"])
    assert count not in result.stderr.str()  # quoted shortened, not 5000 digits
