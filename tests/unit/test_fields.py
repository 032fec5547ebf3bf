"""gateway.fields: the numbers HTTP fields hold, as the gateway reads them."""

from hypothesis import given
from hypothesis import strategies as st

from gateway.fields import MAX_DIGITS, decimal


def test_a_field_is_a_number_only_as_ascii_digits_and_no_longer_than_any_length_here():
    assert decimal(b"0") == 0
    assert decimal(b"1234") == 1234
    assert decimal(b"9" * MAX_DIGITS) == 10**MAX_DIGITS - 1
    for junk in (
        b"",
        b"-1",
        b"+1",
        b"1_000",
        b" 1",
        b"1.5",
        b"0x10",
        b"\xb2",
        b"9" * (MAX_DIGITS + 1),
        b"9" * 5000,
    ):
        assert decimal(junk) is None, junk


@given(st.binary(max_size=30))
def test_any_bytes_give_a_number_or_none_and_never_raise(value: bytes):
    number = decimal(value)
    assert number is None or (number >= 0 and str(number).encode() == value.lstrip(b"0").rjust(1, b"0"))
