"""A `SparkSession` that can read the flushed tables: Java, the JDBC driver, worker Python.

`spark_session()` checks what PySpark would otherwise report as an unreadable JVM crash
(no Java, an old Java), finds the PostgreSQL JDBC driver, makes the Python workers use
this interpreter, and registers the ``threadlog`` data source. Given ``jvm_log``, a local
driver JVM writes its console output (the JVM's own warnings, Spark's log4j lines) to that
file instead of this process's stderr, so a program's output stays its own. Inside ``spark-submit``
(or a ``pyspark`` shell) the submitter owns the master and the jars; the helper only adds
what is missing and registers the data source.
"""

from __future__ import annotations

import glob
import ipaddress
import os
import re
import shutil
import socket
import subprocess
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from buffered_store.errors import ConfigError

JDBC_JAR_ENV = "BUFSTORE_JDBC_JAR"
POSTGRES_JDBC_PACKAGE = "org.postgresql:postgresql:42.7.4"
"""Maven coordinate used through ``spark.jars.packages`` when no local jar is found."""
MIN_JAVA = 17
STANDALONE_PORT = 7077
"""Port of a standalone master URL that names none (Spark's default)."""
MASTER_PROBE_TIMEOUT_S = 5.0

WELL_KNOWN_JARS = (
    "/usr/share/java/postgresql.jar",  # Debian/Ubuntu libpostgresql-jdbc-java
    "/usr/share/java/postgresql-jdbc4.jar",
    "/usr/share/java/postgresql-jdbc.jar",  # Fedora/RHEL postgresql-jdbc
    "/usr/local/share/java/postgresql.jar",
    "/usr/local/share/java/classes/postgresql.jar",  # FreeBSD
    "/opt/homebrew/share/java/postgresql*.jar",
    "~/.ivy2/jars/org.postgresql_postgresql-*.jar",  # an earlier spark.jars.packages
    "~/.ivy2.5.2/jars/org.postgresql_postgresql-*.jar",
    "~/.m2/repository/org/postgresql/postgresql/*/postgresql-*.jar",
)
"""Local places of the PostgreSQL JDBC driver, searched in order (globs allowed)."""


class SparkSetupError(ConfigError):
    """Spark cannot start or cannot read the tables here (Java or the JDBC driver)."""


@dataclass(frozen=True, slots=True)
class JdbcDriver:
    """Where the PostgreSQL JDBC driver comes from: a local jar or a Maven package."""

    jar: str | None
    package: str | None
    origin: str
    """How it was found, for messages: the variable, the path, or "maven"."""

    def conf(self) -> dict[str, str]:
        """The Spark settings that put the driver on the classpath."""
        if self.jar is not None:
            return {"spark.jars": self.jar}
        assert self.package is not None
        return {"spark.jars.packages": self.package}


def find_jdbc_driver(env: Mapping[str, str] | None = None) -> JdbcDriver:
    """``$BUFSTORE_JDBC_JAR``, else a well-known local jar, else the Maven coordinate.

    A jar named by the variable must exist: a typo should not silently fall back to a
    download. The Maven coordinate only works on machines that reach Maven Central.
    """
    env = os.environ if env is None else env
    explicit = env.get(JDBC_JAR_ENV, "").strip()
    if explicit:
        if not Path(explicit).expanduser().is_file():
            raise SparkSetupError(f"{JDBC_JAR_ENV}={explicit} is not a file")
        return JdbcDriver(str(Path(explicit).expanduser()), None, JDBC_JAR_ENV)
    for pattern in WELL_KNOWN_JARS:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob.glob(expanded)) if any(c in expanded for c in "*?[") else []
        if not matches and Path(expanded).is_file():
            matches = [expanded]
        if matches:
            return JdbcDriver(matches[-1], None, matches[-1])
    return JdbcDriver(None, POSTGRES_JDBC_PACKAGE, "maven")


def java_version(output: str) -> int | None:
    """Major version from ``java -version`` output (``1.8.0_x`` is 8), or None."""
    match = re.search(r'version "(\d+)(?:\.(\d+))?', output)
    if match is None:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def find_java(env: Mapping[str, str] | None = None) -> str:
    """The `java` Spark will launch (``$JAVA_HOME/bin/java``, else `java` on PATH).

    Raises `SparkSetupError` naming the fix when it is missing or older than Java 17.
    """
    env = os.environ if env is None else env
    home = env.get("JAVA_HOME", "").strip()
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java", path=env.get("PATH"))
    hint = (
        "Spark needs Java 17 or newer: install it (Debian/Ubuntu: apt-get install "
        "openjdk-17-jre-headless; `make java` does it) or set JAVA_HOME"
    )
    if not java or not os.access(java, os.X_OK):
        where = f"JAVA_HOME={home}" if home else "PATH"
        raise SparkSetupError(f"no Java found (looked in {where}). {hint}")
    try:
        probe = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SparkSetupError(f"{java} -version failed ({exc}). {hint}") from exc
    version = java_version(probe.stderr + probe.stdout)
    if version is None or version < MIN_JAVA:
        raise SparkSetupError(f"{java} is Java {version or 'of unknown version'}. {hint}")
    return java


def configure_worker_python(env: dict[str, str] | None = None) -> str:
    """Make Spark's Python workers run this interpreter unless told otherwise.

    Without it the workers start whatever ``python3`` is on PATH, which lacks this
    project's packages. An existing ``PYSPARK_PYTHON`` (a cluster's) is kept.
    """
    target = os.environ if env is None else env
    target.setdefault("PYSPARK_PYTHON", sys.executable)
    target.setdefault("PYSPARK_DRIVER_PYTHON", target["PYSPARK_PYTHON"])
    return target["PYSPARK_PYTHON"]


def under_spark_submit(env: Mapping[str, str] | None = None) -> bool:
    """True inside ``spark-submit`` or a ``pyspark`` shell (a JVM gateway already exists)."""
    env = os.environ if env is None else env
    return bool(env.get("PYSPARK_GATEWAY_PORT"))


def standalone_masters(master: str) -> list[tuple[str, int]]:
    """Host and port of each master a ``spark://h1:p1,h2:p2`` URL names (empty for others).

    Several masters are a standalone high-availability setup; a missing port is 7077.
    """
    if not master.startswith("spark://"):
        return []
    found: list[tuple[str, int]] = []
    for part in master.removeprefix("spark://").split(","):
        part = part.strip().rstrip("/")
        if not part:
            continue
        host, port = part, STANDALONE_PORT
        bracketed = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", part)  # [::1]:7077
        if bracketed:
            host, port = bracketed.group(1), int(bracketed.group(2) or STANDALONE_PORT)
        elif part.count(":") == 1:
            name, _, digits = part.partition(":")
            if not digits.isdigit():
                raise SparkSetupError(f"the master URL {master} has a bad port: {part}")
            host, port = name, int(digits)
        found.append((host, port))
    if not found:
        raise SparkSetupError(f"the master URL {master} names no host")
    return found


def _system_resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return [str(info[4][0]) for info in infos]


def driver_on_loopback(master: str, resolve: Callable[[str], Sequence[str]] | None = None) -> bool:
    """Whether the driver should bind 127.0.0.1: a local master, or every standalone
    master on a loopback address (then its workers, on the same machine, are too).

    A name that does not resolve counts as not loopback: Spark's own default stays.
    """
    if master.startswith("local"):
        return True
    hosts = [host for host, _ in standalone_masters(master)]
    if not hosts:
        return False
    resolve = resolve or _system_resolve
    for host in hosts:
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in resolve(host)]
        if not addresses or not all(a.is_loopback for a in addresses):
            return False
    return True


def check_master(master: str, *, timeout_s: float = MASTER_PROBE_TIMEOUT_S) -> None:
    """Fail at once, naming the URL, when no standalone master listens at `master`.

    Without it Spark retries the registration for about 60 s and then fails with a Java
    stack trace. A TCP connection to one of the masters is enough to go on (nothing is
    sent, so the master logs nothing); other master URLs (``local``, ``yarn``, ``k8s``)
    are not checked.
    """
    reasons: list[str] = []
    for host, port in standalone_masters(master):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return
        except TimeoutError:
            reasons.append(f"{host}:{port} did not answer within {timeout_s:.0f} s")
        except socket.gaierror as exc:
            reasons.append(f"{host} is not a known host ({exc.strerror})")
        except OSError as exc:
            reasons.append(f"{host}:{port}: {exc.strerror or exc}")
    if reasons:
        raise SparkSetupError(
            f"no Spark master at {master} ({'; '.join(reasons)}): start one "
            "(docs/how-to/spark.md, 'Run on a standalone cluster') or fix the master URL"
        )


def session_conf(
    *,
    master: str | None,
    driver: JdbcDriver | None,
    submitted: bool,
    conf: Mapping[str, str] | None = None,
    resolve: Callable[[str], Sequence[str]] | None = None,
) -> dict[str, str]:
    """The settings `spark_session` applies (tested without a JVM).

    `resolve` maps a master's host name to its addresses (default: the system resolver).
    """
    out: dict[str, str] = {}
    if master is not None:
        out["spark.master"] = master
    elif not submitted:
        out["spark.master"] = "local[*]"
    if driver_on_loopback(out.get("spark.master", ""), resolve):
        # A laptop's hostname often resolves to an address nothing listens on; and when
        # the master listens on loopback, so do its workers: the executors must find the
        # driver there too, not on whatever interface Spark picks for the hostname.
        out["spark.driver.bindAddress"] = "127.0.0.1"
        out["spark.driver.host"] = "127.0.0.1"
    if driver is not None:
        out.update(driver.conf())
    # Days and timestamps of the jobs are UTC, whatever the machine's zone.
    out["spark.sql.session.timeZone"] = "UTC"
    out.update(conf or {})
    return out


def spark_session(
    app_name: str = "bufstore",
    *,
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    driver: JdbcDriver | None = None,
    jvm_log: str | os.PathLike[str] | None = None,
) -> Any:
    """Get or create a `SparkSession` able to read the store's tables.

    Args:
        app_name: the application name shown by the cluster manager.
        master: e.g. ``local[4]`` or ``spark://host:7077``; by default ``local[*]``,
            or what ``spark-submit`` was given. A ``spark://`` master that nothing
            listens at fails at once with `SparkSetupError` (`check_master`); one on a
            loopback address gets a driver bound to 127.0.0.1, like a local master.
        conf: more Spark settings; they win over the helper's.
        driver: the JDBC driver to use; by default `find_jdbc_driver()`. Under
            ``spark-submit`` a driver passed with ``--jars``/``--packages`` is kept.
        jvm_log: a file (appended to) for the console output of the driver JVM this call
            starts for a local master: the JVM's warnings, Spark's log lines and the Python
            workers' stderr. By default they go to this process's stderr. Has no effect
            under ``spark-submit`` or when this process already runs a Spark JVM.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        register_datasource(active)
        return active
    submitted = under_spark_submit()
    if not submitted:
        find_java()
        configure_worker_python()
    if driver is None and not (submitted and _submitted_driver()):
        driver = find_jdbc_driver()
    builder = SparkSession.builder.appName(app_name)
    settings = session_conf(master=master, driver=driver, submitted=submitted, conf=conf)
    for key, value in settings.items():
        builder = builder.config(key, value)
    standalone = "" if submitted else settings.get("spark.master", "")
    if not standalone.startswith("spark://"):
        standalone = ""
    if standalone:
        check_master(standalone)
    if not submitted and settings.get("spark.driver.host") == "127.0.0.1":
        # Keep the driver JVM's own services (block manager, shuffle, UI) on loopback too:
        # the driver settings above do not reach what starts before the session reads them.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if not submitted and (master or "local").startswith("local") and jvm_log is not None:
        _start_logged_context(app_name, settings, Path(jvm_log))
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # Py4JJavaError and the like; only rewritten for a master
        if not standalone:
            raise
        raise SparkSetupError(
            f"Spark could not register with a master at {standalone}: is that the master's "
            f"port (7077 by default; 8080 is its web UI)? ({_first_line(exc)})"
        ) from exc
    register_datasource(spark)
    return spark


def _first_line(exc: BaseException) -> str:
    """The Java exception's own line of a Py4J error (its first line only names the call)."""
    lines = [line.strip().removeprefix(": ") for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "Exception:" in line or "Error:" in line:
            return line
    return lines[0] if lines else type(exc).__name__


def _start_logged_context(app_name: str, settings: Mapping[str, str], log_path: Path) -> None:
    """Start the driver JVM with its stdout and stderr in `log_path`, and a context on it.

    Log levels cannot do this: the JVM prints "Using incubator modules" before any logger
    exists (Spark always adds ``--add-modules=jdk.incubator.vector``), and Spark prints its
    log-profile banner to stderr directly. `launch_gateway`'s ``popen_kwargs`` is PySpark's
    own hook for capturing the JVM's output; the `SparkContext` made on that gateway is the
    one ``getOrCreate`` then returns.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    # A JVM already running in this process keeps its output where it goes.
    if SparkContext._gateway is not None or SparkContext._active_spark_context is not None:
        return
    spark_conf = SparkConf().setAppName(app_name).setAll(list(settings.items()))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        try:
            popen = {"stdout": log, "stderr": log}
            gateway = launch_gateway(spark_conf, popen_kwargs=popen)  # type: ignore[no-untyped-call]
        except Exception as exc:  # PySparkRuntimeError, OSError: the reason is in the log
            tail = log_path.read_text(errors="replace")[-2000:]
            raise SparkSetupError(
                f"Spark's JVM did not start ({exc}); its output, in {log_path}, ends with:\n{tail}"
            ) from exc
    SparkContext(conf=spark_conf, gateway=gateway)


def _submitted_driver() -> bool:
    """Whether ``spark-submit`` already put a PostgreSQL driver on the classpath."""
    from pyspark import SparkConf
    from pyspark.core.context import SparkContext

    SparkContext._ensure_initialized()
    conf = SparkConf()
    given = conf.get("spark.jars", "") + "," + conf.get("spark.jars.packages", "")
    return "postgresql" in given.lower()


_REGISTERED: weakref.WeakSet[Any] = weakref.WeakSet()


def register_datasource(spark: Any) -> None:
    """Register the ``threadlog`` data source with a session (once per session)."""
    from buffered_store.spark.datasource import ThreadLogDataSource

    if spark not in _REGISTERED:
        spark.dataSource.register(ThreadLogDataSource)
        _REGISTERED.add(spark)
