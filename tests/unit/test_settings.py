"""Stack settings: what the processors are told by the environment docker-compose and Kubernetes give them."""

import redis

from streams.settings import StackSettings


def test_redis_password_from_the_environment_reaches_the_client_and_not_the_logs(monkeypatch):
    monkeypatch.setenv("TANGRAM_REDIS_HOST", "redis")
    monkeypatch.setenv("TANGRAM_REDIS_PASSWORD", "s3cr/t@:x")
    settings = StackSettings()
    pool = redis.Redis.from_url(settings.redis_url).connection_pool
    assert pool.connection_kwargs["password"] == "s3cr/t@:x"  # percent-encoded in the URL, decoded by redis-py
    assert pool.connection_kwargs["host"] == "redis"
    assert "s3cr" not in repr(settings)


def test_local_stack_redis_has_no_password(monkeypatch):
    monkeypatch.delenv("TANGRAM_REDIS_PASSWORD", raising=False)
    assert StackSettings().redis_url.startswith("redis://127.0.0.1:")
