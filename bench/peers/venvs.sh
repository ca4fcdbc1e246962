# Sourced by bench/peers/setup.sh and scripts/peers-here.sh: where the
# peers' virtual environments are. One per library, so that neither's
# packages can change the other's: $FERRY_PEERS_VENVS/nixl and
# $FERRY_PEERS_VENVS/mooncake, outside the checkout and the target
# directory, so that `cargo clean` keeps them and every checkout shares
# them (what is in them does not depend on the checkout, except the FERRY
# plugin a script installs, which each script installs again before it
# measures it).
FERRY_PEERS_VENVS=${FERRY_PEERS_VENVS:-$HOME/.cache/ferry-peers}
NIXL_PY=$FERRY_PEERS_VENVS/nixl/bin/python
MOONCAKE_PY=$FERRY_PEERS_VENVS/mooncake/bin/python
