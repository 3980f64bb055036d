"""The SDK's retry rule the simulator's callers follow (`fleet.policy.sdk_client`), held to the
real `openai` client's own (`_calculate_retry_timeout`, `_should_retry`) on the same draws. The
longest Retry-After it honours is the installed client's (`openai` 3.x: two minutes); the fleet
and the simulator assume a minute (`SDK_LONGEST_RETRY_AFTER_S`), what older clients honour."""

from __future__ import annotations

import httpx
import openai
import openai._base_client as base
import pytest
from openai._constants import MAX_RETRY_AFTER_DELAY
from openai._models import FinalRequestOptions

from fleet.policy.sdk_client import backoff_s, honours_retry_after, retries_refusal, retry_wait_s


def _sdk_wait(monkeypatch: pytest.MonkeyPatch, retries_taken: int, u: float, headers: dict[str, str]) -> float:
    """What the openai client waits before its next attempt, its random draw fixed at `u`."""
    monkeypatch.setattr(base, "random", lambda: u)
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:1/v1", max_retries=2)
    options = FinalRequestOptions.construct(method="post", url="/chat/completions")
    return client._calculate_retry_timeout(2 - retries_taken, options, httpx.Headers(headers))


@pytest.mark.parametrize("retries_taken", [0, 1, 2, 5])
@pytest.mark.parametrize("u", [0.0, 0.3, 0.999])
def test_the_backoff_is_the_openai_clients(monkeypatch: pytest.MonkeyPatch, retries_taken: int, u: float) -> None:
    ours = backoff_s(retries_taken, u)
    assert ours == pytest.approx(_sdk_wait(monkeypatch, retries_taken, u, {}))
    assert 0.75 * min(0.5 * 2**retries_taken, 8.0) - 1e-9 <= ours <= min(0.5 * 2**retries_taken, 8.0)


@pytest.mark.parametrize("header", [{"retry-after-ms": "2500"}, {"retry-after": "7"}, {"retry-after": "61"},
                                    {"retry-after": "0"}, {"retry-after": "130"}])
def test_a_retry_after_is_waited_as_the_openai_client_waits_it(monkeypatch: pytest.MonkeyPatch,
                                                               header: dict[str, str]) -> None:
    after = int(header["retry-after-ms"]) / 1000 if "retry-after-ms" in header else float(header["retry-after"])
    longest = MAX_RETRY_AFTER_DELAY  # the installed client's (the fleet assumes a minute: the default here)
    assert retry_wait_s(1, 0.5, retry_after_s=after, longest_s=longest) == pytest.approx(
        _sdk_wait(monkeypatch, 1, 0.5, header))
    assert honours_retry_after(after) == (0 < after <= 60)


def test_a_client_that_does_not_honour_retry_after_backs_off_its_own_way() -> None:
    assert retry_wait_s(0, 0.0, retry_after_s=5.0, honour=False) == 0.5
    assert retry_wait_s(3, 0.0, retry_after_s=5.0, honour=False, initial_s=1.0, max_s=4.0) == 4.0


@pytest.mark.parametrize("status,should,after,expected", [
    (429, None, 2.0, True), (429, False, 2.0, False), (400, True, None, True), (429, True, 121.0, False),
    (503, None, None, True), (504, None, None, True), (400, None, None, False), (409, None, None, True),
])
def test_whether_a_refusal_is_retried_is_the_openai_clients(status: int, should: bool | None, after: float | None,
                                                             expected: bool) -> None:
    headers = {} if should is None else {"x-should-retry": "true" if should else "false"}
    if after is not None:
        headers["retry-after"] = str(after)
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:1/v1")
    response = httpx.Response(status, headers=headers, request=httpx.Request("POST", "http://127.0.0.1:1/v1"))
    assert client._should_retry(response) == expected
    assert retries_refusal(status, should, after, MAX_RETRY_AFTER_DELAY) == expected
