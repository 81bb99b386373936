"""The embedded Celery broker: kombu's file-system transport, made safe to read while written.

Kombu's own transport (5.7) creates a message file under its final name and only then
writes it, while a consumer takes any file with that name at once (it moves the file away,
then reads it). A consumer that comes between the two reads an empty message, and
`json.loads` of it kills the worker ("Unrecoverable error: JSONDecodeError", kombu issue
#1551): under `make run` that stopped the watchdogs after 11 to 15 minutes.

Here a message is written under a name consumers ignore and renamed into place once whole
(`os.replace` is atomic on one file system), an exchange's table of bindings is replaced the
same way (kombu truncates it in place, and a publisher reading it then drops its message), and
a message that still cannot be read (one
left half-written by a process killed mid-write, or by an older kombu writer) is logged and
dropped instead of killing the consumer. Watchdog and scoring tasks are periodic and
idempotent, so a dropped tick is redone by the next one.

`register()` names the transport `elephant-files`; `config/celery.py` calls it so that
every process that talks to the broker (gateway and worker) knows the name.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from time import monotonic

from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

SCHEME = "elephant-files"
_PARTIAL = ".partial-"  # consumers take only names of the form "<stamp>_<uuid>.<queue>.msg"

logger = logging.getLogger(__name__)


# The signatures of `_put` and `_get` are filesystem.Channel's, which kombu's abstract channel does not match
class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: dict, **kwargs: object) -> None:  # type: ignore[override]
        """Write `payload` whole under a name no consumer takes, then rename it into `queue`."""
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, _PARTIAL + name)
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise filesystem.ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _get(self, queue: str) -> dict:  # type: ignore[override]
        """The next readable message of `queue`; unreadable ones are logged and dropped."""
        while True:
            try:
                return super()._get(queue)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                logger.warning("broker: dropped an unreadable message on queue %s (%s)", queue, exc)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        """Add a binding to the exchange's table, replacing the table file whole: kombu's own
        truncates the file in place, and a publisher reading it meanwhile finds no queue and
        drops its message. Binders queue on a lock file beside it."""
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with open(file.with_suffix(".lock"), "wb") as lock_file:
            filesystem.lock(lock_file, filesystem.LOCK_EX)
            try:
                queues = (
                    [filesystem.exchange_queue_t(*q) for q in json.loads(file.read_text())] if file.exists() else []
                )
                if binding in queues:
                    return
                partial = file.with_name(_PARTIAL + file.name)
                partial.write_text(dumps([binding, *queues]))
                os.replace(partial, file)
            except OSError as exc:
                raise filesystem.ChannelError(f"Cannot open {file}") from exc
            finally:
                filesystem.unlock(lock_file)


class Transport(filesystem.Transport):
    Channel = Channel
    global_state = filesystem.Transport.global_state


def register() -> None:
    """Make `elephant-files://` a broker URL kombu understands, in this process."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
