"""The grammar of every value that reaches a bundle's generated files, checked before a file is written.

A bundle is run by someone other than its author, often with more rights, so a value from a cluster
spec, a plan or an export option must never become code in `launch_node.sh` or `slurm.sbatch`, nor
start a new line in any file (a comment included). Each value has the strictest grammar its use allows:

* machines (and the host of a rendezvous endpoint): a host name per RFC 1123, or an IPv4/IPv6 literal;
* ports: 1-65535;
* job names: a Kubernetes name (RFC 1123 label: lower-case letters, digits, '-', at most 63);
* Kubernetes label values (the GPU product a manifest's nodeSelector asks for): at most 63 letters,
  digits, '-', '_' and '.', starting and ending with a letter or digit;
* images: an OCI image reference (`[registry[:port]/]path[:tag][@algorithm:hex]`);
* runner arguments: option words of letters, digits and `_ . , : = / @ + % -` (no shell metacharacters);
* file names: the POSIX portable file name characters;
* Slurm names (partition, account, QOS, node feature, GRES type): letters, digits, '_', '.', '-';
* Slurm node lists: host list expressions such as gpu[01-04],gpu7; Slurm time limits as sbatch --time reads them;
* names only shown in prose (devices, GPU types, cluster and model names): any printable single line.

Every checker returns None for a good value, else a one-line reason naming what is allowed; the
callers prefix the field. The launch files quote values anyway (`shlex.quote`, JSON-quoted YAML
scalars), so the grammar is the first wall, not the only one.
"""
from __future__ import annotations

import ipaddress
import re
import unicodedata
from typing import Any

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_K8S_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(
    rf"(?:(?P<domain>{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?)/)?"
    rf"(?P<path>{_PATH_PART}(?:/{_PATH_PART})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}))?")
_RUN_ARG = re.compile(r"[A-Za-z0-9_.,:=/@+%-]+")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_SLURM_NODELIST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(?:\[[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*\][A-Za-z0-9_.-]*)*"
                             r"(?:,[A-Za-z0-9_][A-Za-z0-9_.-]*(?:\[[0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*\][A-Za-z0-9_.-]*)*)*")
_SLURM_TIME = re.compile(r"[0-9]{1,6}(?::[0-9]{1,2}){0,2}|[0-9]{1,4}-[0-9]{1,2}(?::[0-9]{1,2}){0,2}|UNLIMITED|INFINITE")
_DIGEST = re.compile(r"(?:sha256:)?[0-9a-fA-F]{64}")

MAX_HOST_CHARS = 253
MAX_IMAGE_NAME_CHARS = 255
MAX_RUN_ARG_CHARS = 4096
MAX_RUN_ARGS = 256
MAX_TEXT_CHARS = 256

HOST_RULE = "a host name (RFC 1123: dot-separated labels of letters, digits and '-') or an IPv4/IPv6 address"
ENDPOINT_RULE = ("HOST:PORT with HOST a host name (RFC 1123) or an IPv4 address, [ADDR]:PORT for IPv6, "
                 "and PORT in 1..65535")
K8S_RULE = "a Kubernetes name: lower-case letters, digits and '-', starting and ending with a letter or digit, at most 63"
LABEL_VALUE_RULE = ("a Kubernetes label value: letters, digits, '-', '_' and '.', starting and ending with a letter "
                    "or digit, at most 63")
IMAGE_RULE = "an OCI image reference such as registry.example.com:5000/team/hap-workbench:1.0 (lower-case path, optional :tag, @sha256:...)"
RUN_ARG_RULE = "runner options made of letters, digits and _ . , : = / @ + % - (e.g. --steps 100 --checkpoint-dir /mnt/ckpt)"
FILE_NAME_RULE = "a file name of letters, digits, '.', '_' and '-' that does not start with '.' or '-'"
SLURM_NAME_RULE = "a Slurm name: letters, digits, '_', '.' and '-', not starting with '.' or '-', at most 64"
SLURM_NODELIST_RULE = "a Slurm node list such as gpu[01-04],gpu7 (host names, bracketed numeric ranges, commas)"
SLURM_TIME_RULE = ("a Slurm time limit: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, "
                   "DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS or UNLIMITED")
TEXT_RULE = f"printable text on one line (no control characters), at most {MAX_TEXT_CHARS} characters"


def _shown(value: Any) -> str:
    """The value as a message shows it: repr, so a newline or a control character is visible, cut short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def host_problem(value: Any) -> str | None:
    """None for an RFC 1123 host name or an IP literal (IPv6 bare or in brackets), else why not."""
    if not isinstance(value, str) or not value:
        return f"{_shown(value)} is not {HOST_RULE}"
    if _ip_literal(value.removeprefix("[").removesuffix("]") if value.startswith("[") else value):
        return None
    if len(value) <= MAX_HOST_CHARS and _HOST.fullmatch(value):
        return None
    return f"{_shown(value)} is not {HOST_RULE}"


def _ip_literal(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def port_problem(value: Any) -> str | None:
    """None for a TCP port 1..65535 (an int, or its decimal digits), else why not."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535:
        return None
    return f"port {_shown(value)} is not a number in 1..65535"


def endpoint_problem(value: Any) -> str | None:
    """None for HOST:PORT ([IPv6]:PORT), else why not."""
    if not isinstance(value, str) or ":" not in value:
        return f"{_shown(value)} is not {ENDPOINT_RULE}"
    host, port = value.rsplit(":", 1)
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return f"{_shown(value)} is not {ENDPOINT_RULE}"
    if host_problem(host) or port_problem(port):
        return f"{_shown(value)} is not {ENDPOINT_RULE}"
    return None


def k8s_name_problem(value: Any) -> str | None:
    """None for an RFC 1123 label (a Kubernetes object name, a Slurm job name here), else why not."""
    if isinstance(value, str) and _K8S_NAME.fullmatch(value):
        return None
    return f"{_shown(value)} is not {K8S_RULE}"


def label_value_problem(value: Any) -> str | None:
    """None for a non-empty Kubernetes label value (a nodeSelector's value), else why not."""
    if isinstance(value, str) and _LABEL_VALUE.fullmatch(value):
        return None
    return f"{_shown(value)} is not {LABEL_VALUE_RULE}"


def image_problem(value: Any) -> str | None:
    """None for an OCI image reference, else why not."""
    if isinstance(value, str) and value.isascii():
        m = _IMAGE.fullmatch(value)
        if m and len(value) - len(m.group("tag") or "") - len(m.group("digest") or "") <= MAX_IMAGE_NAME_CHARS:
            return None
    return f"{_shown(value)} is not {IMAGE_RULE}"


def run_args_problem(value: Any) -> str | None:
    """None for a list of runner option words, else why the first bad one is refused."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_RUN_ARGS:
        return f"must be a list of at most {MAX_RUN_ARGS} words, got {_shown(value)}"
    for i, arg in enumerate(value):
        if not isinstance(arg, str) or len(arg) > MAX_RUN_ARG_CHARS or not _RUN_ARG.fullmatch(arg):
            return f"word {i} {_shown(arg)} is not allowed: give {RUN_ARG_RULE}"
    return None


def file_name_problem(value: Any) -> str | None:
    """None for a portable file name (no path, no leading '.' or '-'), else why not."""
    if isinstance(value, str) and len(value) <= 255 and _FILE_NAME.fullmatch(value):
        return None
    return f"{_shown(value)} is not {FILE_NAME_RULE}"


def slurm_name_problem(value: Any) -> str | None:
    """None for a Slurm partition, account, QOS, feature or GRES type name (an #SBATCH value no shell reads), else why not."""
    if isinstance(value, str) and value.isascii() and _SLURM_NAME.fullmatch(value):
        return None
    return f"{_shown(value)} is not {SLURM_NAME_RULE}"


def slurm_nodelist_problem(value: Any) -> str | None:
    """None for a Slurm host list expression of at most 1024 characters, else why not."""
    if isinstance(value, str) and value.isascii() and len(value) <= 1024 and _SLURM_NODELIST.fullmatch(value):
        return None
    return f"{_shown(value)} is not {SLURM_NODELIST_RULE}"


def slurm_time_problem(value: Any) -> str | None:
    """None for a time limit in one of sbatch --time's formats, else why not."""
    if isinstance(value, str) and value.isascii() and _SLURM_TIME.fullmatch(value):
        return None
    return f"{_shown(value)} is not {SLURM_TIME_RULE}"


def text_problem(value: Any) -> str | None:
    """None for a name that is only shown (a README row, a comment): printable, one line, bounded."""
    if isinstance(value, str) and value and len(value) <= MAX_TEXT_CHARS \
            and not any(unicodedata.category(c).startswith(("C", "Z")) and c != " " for c in value):
        return None
    return f"{_shown(value)} is not {TEXT_RULE}"


def digest_arg(text: str) -> str:
    """An argparse `type` for `--digest`: a bundle digest, 64 hex digits (`sha256:` prefix allowed), lower-cased."""
    import argparse

    if not isinstance(text, str) or not _DIGEST.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"expected the bundle's digest that `hap export` printed: 64 hex digits "
                                         f"(optionally sha256:...), got {_shown(text)}")
    return text.strip().lower().removeprefix("sha256:")
