"""Finding Java, the JDBC driver and the worker Python (no JVM started here)."""

from __future__ import annotations

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
    configure_worker_python,
    find_java,
    find_jdbc_driver,
    java_version,
    session_conf,
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
