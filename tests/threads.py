"""Running test calls in threads of their own (tests of decoding from several threads at once)."""
import threading


def run_in_threads(calls, together: bool):
    """Runs every call in a thread of its own, all at once (``together``) or one after the other."""
    results, errors = [None] * len(calls), []
    start = threading.Barrier(len(calls) if together else 1)

    def worker(i):
        try:
            start.wait()
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
        if not together:
            t.join()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    return results
