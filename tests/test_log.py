import io
import json
import subprocess
import sys

from pgflow.log import renders_console


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_renders_for_people_on_a_terminal_and_json_otherwise() -> None:
    assert renders_console("auto", Terminal()) is True
    assert renders_console("auto", io.StringIO()) is False
    assert renders_console("json", Terminal()) is False
    assert renders_console("console", io.StringIO()) is True


SCRIPT = ("import sys; from pgflow import log; log.configure('info', sys.argv[1]);"
          " log.get_logger(replica='r1').info('replica started', roles=['worker'])")


def emitted(log_format: str) -> str:
    done = subprocess.run([sys.executable, "-c", SCRIPT, log_format], capture_output=True,
                          text=True, check=True, timeout=30)
    return done.stderr.strip()


def test_json_lines_are_objects_and_console_lines_are_readable() -> None:
    line = json.loads(emitted("json"))
    assert line["event"] == "replica started" and line["replica"] == "r1"
    assert line["level"] == "info" and line["roles"] == ["worker"]
    console = emitted("console")
    assert "replica started" in console and "replica=r1" in console
    assert not console.startswith("{")
    assert emitted("auto").startswith("{")  # stderr is a pipe here
