"""PD_NATS_URL and PD_REDIS_URL (pdserve/shared/urls.py): a cluster's servers, a Sentinel-watched
primary, a Redis Cluster's nodes, and a malformed URL refused at start naming what is wrong."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.shared.config import Common, GatewaySettings
from pdserve.shared.urls import ClusterTarget, SentinelTarget, cluster_target, nats_servers, sentinel_target


def test_a_cluster_is_its_servers_separated_by_commas():
    assert nats_servers("nats://u:p@10.0.0.1:4222, nats://u:p@10.0.0.2:4222,") == [
        "nats://u:p@10.0.0.1:4222", "nats://u:p@10.0.0.2:4222"]
    assert nats_servers("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]


def test_a_sentinel_url_names_the_sentinels_the_service_the_db_and_both_passwords():
    url = "redis+sentinel://:p%40ss@10.0.0.1:26379,10.0.0.2:26380/pdserve/2?sentinel_password=s"
    assert sentinel_target(url) == SentinelTarget([("10.0.0.1", 26379), ("10.0.0.2", 26380)], "pdserve", 2,
                                                  "p@ss", "s")
    assert sentinel_target("redis+sentinel://h:26379/mymaster") == SentinelTarget([("h", 26379)], "mymaster")
    assert sentinel_target("redis+sentinel://router:p@h:26379/m").username == "router"  # an ACL user
    assert sentinel_target("redis://:p@h:6379/0") is None


def test_a_cluster_url_names_its_nodes_and_the_user():
    assert cluster_target("redis+cluster://router:p%40ss@10.0.0.1:6379,10.0.0.2:6380,") == ClusterTarget(
        [("10.0.0.1", 6379), ("10.0.0.2", 6380)], "p@ss", "router")
    assert cluster_target("redis+cluster://h:7000") == ClusterTarget([("h", 7000)])
    assert cluster_target("redis://h:6379/0") is None
    assert Common(redis_url="redis+cluster://h:7000").prefix_index == "events"


def test_the_redis_prefix_index_is_refused_on_a_cluster():
    """Its scripts build key names a cluster may keep on other nodes: the index stays in router memory."""
    with pytest.raises(ValidationError, match="PD_PREFIX_INDEX=events"):
        Common(redis_url="redis+cluster://h:7000", prefix_index="redis")
    assert Common(redis_url="redis://h:6379/0", prefix_index="redis").prefix_index == "redis"


@pytest.mark.parametrize("field,url,says", [
    ("nats_url", "", "names no server"),
    ("nats_url", "nats://a:4222,http://b:4222", "not a nats://"),
    ("redis_url", "redis+sentinel://h:26379", "ends in /<service>"),
    ("redis_url", "redis+sentinel://h:26379/a/b/c", "ends in /<service>"),
    ("redis_url", "redis+sentinel://h/pdserve", "is not host:port"),
    ("redis_url", "redis+sentinel:///pdserve", "names no Sentinel"),
    ("redis_url", "redis+cluster://h", "is not host:port"),
    ("redis_url", "redis+cluster://", "names no cluster node"),
    ("redis_url", "redis+cluster://h:7000/1", "has no /<db>"),
])
def test_a_malformed_url_fails_the_settings_naming_what_is_wrong(field, url, says):
    with pytest.raises(ValidationError, match=says):
        Common(**{field: url})


def test_a_nats_users_replies_come_to_inboxes_under_its_name():
    from pdserve.shared.urls import nats_inbox

    assert nats_inbox("nats://gateway:pw@a:4222,nats://gateway:pw@b:4222") == "_INBOX.gateway"
    assert nats_inbox("nats://a:4222") == "_INBOX"          # no user: nats-py's default
    assert nats_inbox("nats://s3cr3t-token@a:4222") == "_INBOX"  # a token is no name to put on the bus


def test_settings_errors_name_no_password():
    """A URL that fails validation is named without its credentials, and pydantic does not
    echo the input (startup errors reach logs)."""
    with pytest.raises(ValidationError) as e:
        GatewaySettings(nats_url="http://gateway:s3cret@bus:4222")
    assert "s3cret" not in str(e.value) and "***@bus:4222" in str(e.value)


def test_an_open_api_serves_loopback_only_unless_allowed():
    assert GatewaySettings(gateway_host="127.0.0.1").api_keys == ""
    with pytest.raises(ValidationError, match="PD_ALLOW_OPEN"):
        GatewaySettings(gateway_host="0.0.0.0")
    assert GatewaySettings(gateway_host="0.0.0.0", allow_open=True).allow_open
    assert GatewaySettings(gateway_host="0.0.0.0", api_keys="a:" + "0" * 64).api_keys
