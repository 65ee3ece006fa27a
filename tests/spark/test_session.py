"""Finding Java, the JDBC driver and the worker Python (no JVM started here)."""

from __future__ import annotations

import socket
import stat
import sys
from pathlib import Path

import pytest

from buffered_store.spark import session
from buffered_store.spark.session import (
    JDBC_JAR_ENV,
    POSTGRES_JDBC_PACKAGE,
    JdbcDriver,
    SparkSetupError,
    check_master,
    configure_worker_python,
    driver_on_loopback,
    find_java,
    find_jdbc_driver,
    java_version,
    session_conf,
    standalone_masters,
)


def test_the_jar_variable_wins_and_must_exist(tmp_path: Path) -> None:
    jar = tmp_path / "pg.jar"
    jar.write_bytes(b"PK")
    assert find_jdbc_driver({JDBC_JAR_ENV: str(jar)}) == JdbcDriver(str(jar), None, JDBC_JAR_ENV)
    with pytest.raises(SparkSetupError, match="not a file"):
        find_jdbc_driver({JDBC_JAR_ENV: str(tmp_path / "missing.jar")})


def test_well_known_jars_then_maven(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ivy = tmp_path / "ivy"
    ivy.mkdir()
    for version in ("42.6.0", "42.7.4"):
        (ivy / f"org.postgresql_postgresql-{version}.jar").write_bytes(b"PK")
    known = (str(tmp_path / "nowhere.jar"), str(ivy / "org.postgresql_postgresql-*.jar"))
    monkeypatch.setattr(session, "WELL_KNOWN_JARS", known)
    found = find_jdbc_driver({})
    assert found.jar == str(ivy / "org.postgresql_postgresql-42.7.4.jar")
    assert found.conf() == {"spark.jars": found.jar}

    monkeypatch.setattr(session, "WELL_KNOWN_JARS", (str(tmp_path / "nowhere.jar"),))
    maven = find_jdbc_driver({})
    assert maven == JdbcDriver(None, POSTGRES_JDBC_PACKAGE, "maven")
    assert maven.conf() == {"spark.jars.packages": POSTGRES_JDBC_PACKAGE}


def fake_java(directory: Path, banner: str) -> Path:
    java = directory / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text(f"#!/bin/sh\necho '{banner}' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    return java


def test_missing_or_old_java_gets_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(SparkSetupError, match=r"no Java found .*Java 17 or newer"):
        find_java({"PATH": str(tmp_path)})
    with pytest.raises(SparkSetupError, match="JAVA_HOME"):
        find_java({"JAVA_HOME": str(tmp_path / "jdk")})
    old = fake_java(tmp_path / "jdk8", 'openjdk version "1.8.0_392"')
    with pytest.raises(SparkSetupError, match="Java 8"):
        find_java({"JAVA_HOME": str(old.parent.parent)})
    new = fake_java(tmp_path / "jdk21", 'openjdk version "21.0.2" 2024-01-16')
    assert find_java({"JAVA_HOME": str(new.parent.parent)}) == str(new)


def test_java_version_parsing() -> None:
    assert java_version('openjdk version "17.0.21.1" 2026-11-17') == 17
    assert java_version('java version "1.8.0_401"') == 8
    assert java_version('openjdk version "25" 2025-09-16') == 25
    assert java_version("garbage") is None


def test_worker_python_defaults_to_this_interpreter_but_keeps_a_given_one() -> None:
    env: dict[str, str] = {}
    assert configure_worker_python(env) == sys.executable
    assert env["PYSPARK_DRIVER_PYTHON"] == sys.executable
    given = {"PYSPARK_PYTHON": "/opt/cluster/python"}
    assert configure_worker_python(given) == "/opt/cluster/python"


def test_session_settings() -> None:
    driver = JdbcDriver("/j.jar", None, "test")
    local = session_conf(master=None, driver=driver, submitted=False)
    assert local["spark.master"] == "local[*]"
    assert local["spark.driver.bindAddress"] == "127.0.0.1"
    assert local["spark.jars"] == "/j.jar"
    assert local["spark.sql.session.timeZone"] == "UTC"
    submitted = session_conf(master=None, driver=None, submitted=True, conf={"a": "b"})
    assert "spark.master" not in submitted
    assert "spark.jars" not in submitted
    assert submitted["a"] == "b"
    cluster = session_conf(master="spark://h:7077", driver=driver, submitted=False)
    assert "spark.driver.bindAddress" not in cluster


def test_standalone_master_urls() -> None:
    assert standalone_masters("spark://h:7078") == [("h", 7078)]
    assert standalone_masters("spark://h1:7077,h2") == [("h1", 7077), ("h2", 7077)]
    assert standalone_masters("spark://[::1]:7079") == [("::1", 7079)]
    assert standalone_masters("local[2]") == []
    assert standalone_masters("yarn") == []
    with pytest.raises(SparkSetupError, match="bad port"):
        standalone_masters("spark://h:x")
    with pytest.raises(SparkSetupError, match="names no host"):
        standalone_masters("spark://")


def test_the_driver_binds_loopback_when_the_master_is_there() -> None:
    hosts = {"localhost": ["127.0.0.1", "::1"], "laptop": ["127.0.1.1"], "db": ["10.0.0.5"]}

    def resolve(host: str) -> list[str]:
        return hosts.get(host, [])

    for master in ("local[*]", "spark://127.0.0.1:7077", "spark://localhost", "spark://laptop"):
        conf = session_conf(master=master, driver=None, submitted=False, resolve=resolve)
        assert conf["spark.driver.host"] == conf["spark.driver.bindAddress"] == "127.0.0.1"
    # A master elsewhere (or partly elsewhere, or unknown): Spark picks the address.
    for master in ("spark://db:7077", "spark://127.0.0.1:7077,db:7077", "spark://nowhere"):
        conf = session_conf(master=master, driver=None, submitted=False, resolve=resolve)
        assert "spark.driver.host" not in conf
    assert driver_on_loopback("yarn", resolve) is False


def test_a_master_that_does_not_answer_fails_at_once_naming_the_url() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        check_master(f"spark://127.0.0.1:{up}")
        check_master(f"spark://127.0.0.1:{down},127.0.0.1:{up}")  # one of two HA masters
        url = f"spark://127.0.0.1:{down}"
        with pytest.raises(SparkSetupError) as info:
            check_master(url)
    message = str(info.value)
    assert message.startswith(f"no Spark master at {url} (127.0.0.1:{down}: Connection refused)")
    assert "\n" not in message
    with pytest.raises(SparkSetupError, match="not a known host"):
        check_master("spark://no-such-host.invalid:7077")
