#!/usr/bin/env bash
# tests/rxe/run.sh — run a command inside a throw-away QEMU VM that has a real
# ibverbs device: soft-RoCE (rdma_rxe) on Debian 12's stock kernel.
#
# usage: tests/rxe/run.sh [--bin PATH]... [--perf] [--two [--rails 2]] [--] [GUEST_COMMAND...]
#
# Why a VM: CI hosts have no RDMA NIC and their kernels are built without
# InfiniBand, so ibverbs code paths can only be exercised against rxe in a
# guest kernel. KVM does not work on these hosts, so the VM runs under TCG
# (slow, but real verbs, real RC queue pairs, real RDMA WRITE/READ).
#
# Nothing is installed on the host. Debian packages (kernel, QEMU, rdma-core
# userspace, perftest, busybox) are `apt-get download`ed into a cache and
# only extracted: Debian 12's qemu-system-x86 cannot be installed next to a
# newer qemu-utils without removing it, and CI should not mutate the host.
# busybox-static doubles as the host-side depmod and cpio, so no kmod/cpio
# packages are needed either.
#
# The guest is a busybox initramfs (no disk). Its /init (tests/rxe/guest/init)
# creates rxe0 on a dummy netdev, optionally runs the perftest battery, runs
# GUEST_COMMAND and prints FERRY-RXE-EXIT=<rc> on the serial console, which
# is this script's stdout. We exit with that rc; anything else (download or
# boot failure, timeout, missing marker) exits 125 (124 for a timeout).
#
# --two boots two VMs, "a" and "b", from the same initramfs, joined by two
# virtual wires (QEMU socket netdevs over the host's loopback): "wire"
# carries rxe0's RoCE traffic and everything ferry sends, and is what tests
# make lossy (tc netem), take down or cut; "mgmt" is never touched, and
# carries a command agent in VM a (`on-peer CMD` in VM b runs CMD there).
# GUEST_COMMAND runs in VM b; VM a stops when it is done. With --rails 2
# each VM gets a third wire, "wire1", and a second soft-RoCE device, rxe1,
# on it: two rails, for ferry's multi-NIC tests.
#
# See tests/rxe/README.md for options, environment variables and timings.
set -Eeuo pipefail
# Any unexpected failure of the harness itself exits 125, so that a caller
# can tell it from the guest command's own exit status.
trap 'echo "[rxe] error: line $LINENO: command exited $?" >&2; exit 125' ERR

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ARCH=x86_64-linux-gnu
CACHE=${FERRY_RXE_CACHE:-$HOME/.cache/ferry-rxe}
TIMEOUT=${FERRY_RXE_TIMEOUT:-900}   # whole VM run (boot + perf + command), seconds
MEM=${FERRY_RXE_MEM:-2048}          # MiB; tests move up to 64 MiB per side, binaries live in RAM
SMP=${FERRY_RXE_SMP:-}              # default 2 (1 each with --two); see tests/rxe/README.md
LOG=${FERRY_RXE_LOG:-$CACHE/last-console.log}

# Default guest command: prove the device works (device attributes plus a
# short RC RDMA WRITE between two processes), so the harness can be checked alone.
SMOKE='ibv_devinfo -d rxe0 && rxe-pair ib_write_bw -s 65536 -n 200'

# Guest userspace: rdma-core (libibverbs + the rxe provider, librdmacm),
# their tools, perftest, iproute2 for `rdma link add` and `ip`, busybox.
GUEST_PKGS=(busybox-static iproute2 libibverbs1 ibverbs-providers ibverbs-utils
            librdmacm1 rdmacm-utils libibumad3 perftest libpci3
            libnl-3-200 libnl-route-3-200)
# QEMU and the libraries a Debian 12 host typically lacks for it. Anything
# else missing on this particular host is added by missing_deps below.
QEMU_PKGS=(qemu-system-x86 qemu-system-common qemu-system-data seabios
           libcapstone4 libfdt1 libpmem1 libslirp0 libvdeplug2 libndctl6 libdaxctl1)
# Kernel modules the guest loads; their dependencies are added automatically.
MODULES=(rdma_rxe rdma_ucm crc32_generic dummy virtio_pci virtio_net sch_netem
         sch_prio cls_u32 act_gact)
# Guest tools copied from the extracted packages (with their libraries).
GUEST_TOOLS=(usr/bin/ibv_devinfo usr/bin/ibv_devices usr/bin/ibv_rc_pingpong
             usr/bin/ib_write_bw usr/bin/ib_read_bw usr/bin/ib_send_bw usr/bin/ib_atomic_bw
             usr/bin/ib_write_lat usr/bin/ib_read_lat usr/bin/ib_send_lat
             usr/bin/rping usr/bin/rdma bin/ip sbin/tc)

log() { echo "[rxe $(date +%T)] $*" >&2; }
die() { log "error: $*"; exit 125; }
usage() {
    cat <<EOF
usage: tests/rxe/run.sh [--bin PATH]... [--perf] [--two [--rails 2]] [--] [GUEST_COMMAND...]

  --bin PATH   copy a host-built binary (and the libraries ldd lists) into the
               guest's /opt/ferry/bin, which is on the guest's PATH; repeatable
  --perf       also run the perftest battery (ib_write_bw/ib_read_bw at 4 KiB,
               64 KiB, 1 MiB; ib_write_lat at 8 B), printing "PERF ..." lines
  --two        boot two VMs joined by a virtual wire; the command runs in VM b,
               VM a serves as the peer (on-peer CMD runs CMD there)
  --rails 2    with --two: a second wire (wire1, 10.88.1.x) and a second
               soft-RoCE device (rxe1) on it in each VM: two rails
  GUEST_COMMAND  a command line for the guest's sh (words are joined with
               spaces); default: $SMOKE

The guest exports FERRY_RXE=1 FERRY_RXE_DEVICE=rxe0 FERRY_RXE_GID_INDEX=<n>
FERRY_RXE_IP=10.77.0.1 (with --two: 10.88.0.2 in b, and FERRY_RXE_PEER_IP=10.88.0.1,
FERRY_RXE_WIRE=wire, FERRY_RXE_AGENT=10.99.0.1:7000). Exit status: the guest command's; 125 harness failure;
124 timeout. Env: FERRY_RXE_CACHE FERRY_RXE_TIMEOUT FERRY_RXE_MEM FERRY_RXE_SMP
FERRY_RXE_LOG (see tests/rxe/README.md).
EOF
}

# ------------------------------------------------------------ arguments
BINS=()
PERF=0
VMS=1
RAILS=1
while [ $# -gt 0 ]; do
    case $1 in
        --bin)   [ $# -ge 2 ] || die "--bin needs a path"; BINS+=("$2"); shift 2 ;;
        --bin=*) BINS+=("${1#--bin=}"); shift ;;
        --perf)  PERF=1; shift ;;
        --two)   VMS=2; shift ;;
        --rails) [ $# -ge 2 ] || die "--rails needs a count"; RAILS=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        --)      shift; break ;;
        -*)      die "unknown option $1 (try --help)" ;;
        *)       break ;;
    esac
done
GUEST_CMD=${*:-$SMOKE}
# One VM: 1 vCPU makes two busy-polling processes share a CPU (~25x slower).
# Two VMs hold one ferry process each, and the host has 2 cores for both.
[ -n "$SMP" ] || SMP=$((3 - VMS))
case $RAILS in 1) ;; 2) [ "$VMS" = 2 ] || die "--rails 2 needs --two" ;; *) die "--rails takes 1 or 2" ;; esac
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "FERRY_RXE_TIMEOUT must be a number of seconds"
for b in "${BINS[@]}"; do
    if [ ! -f "$b" ] || [ ! -x "$b" ]; then die "--bin $b: not an executable file"; fi
done

T_START=$(date +%s)
mkdir -p "$CACHE/debs"
DEBS=$CACHE/debs

# ------------------------------------------------ 1. download (never install)
# One run at a time may touch the cache; concurrent runs wait here.
exec 9> "$CACHE/lock"
flock -w 1800 9 || die "timed out waiting for the cache lock $CACHE/lock"

APT_OPTS=(-q)
# As root, apt downloads as the unprivileged _apt user, which cannot write
# into $HOME/.cache, so it falls back to root with a warning: ask for root.
[ "$(id -u)" = 0 ] && APT_OPTS+=(-o APT::Sandbox::User=root)

apt_update() {
    [ "$(id -u)" = 0 ] || die "apt package lists are missing or stale; run 'apt-get update' as root"
    log "apt-get update"
    timeout 600 apt-get "${APT_OPTS[@]}" -qq update || die "apt-get update failed"
}

# Packages apt would have to install on this host to satisfy "$@": the
# dependencies this host lacks. Simulation only (-s), nothing is installed.
missing_deps() {
    apt-get -s install --no-install-recommends "$@" 2>/dev/null | awk '$1 == "Inst" { print $2 }' || true
}

resolve_packages() {  # sets KPKG, GUEST_LIST, QEMU_LIST
    # apt's answers only change with the package lists or the host's installed
    # set, and asking costs ~3 s per run: reuse them while neither changed.
    local key saved=$CACHE/resolved
    key=$(stat -c '%n %Y %s' /var/lib/dpkg/status /var/lib/apt/lists/* 2>/dev/null | md5sum)
    if [ -f "$saved" ] && [ "$(head -n 1 "$saved")" = "$key" ]; then
        # shellcheck disable=SC1090  # our own `declare -p` output, see below
        . <(tail -n +2 "$saved")
        return 0
    fi
    # The current kernel ABI package, e.g. linux-image-6.1.0-56-amd64.
    KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null |
           awk '/Depends: linux-image-[0-9]/ { print $2; exit }') || true
    [ -n "$KPKG" ] || return 1
    # sort -u: the explicit lists and missing_deps overlap.
    mapfile -t GUEST_LIST < <({ printf '%s\n' "${GUEST_PKGS[@]}"; missing_deps "${GUEST_PKGS[@]}"; } | sort -u)
    mapfile -t QEMU_LIST < <({ printf '%s\n' "${QEMU_PKGS[@]}"; missing_deps "${QEMU_PKGS[@]}"; } | sort -u)
    # declare -g: re-read inside this function, a plain declare would be local.
    { echo "$key"; declare -p KPKG GUEST_LIST QEMU_LIST | sed 's/^declare -/declare -g -/'; } > "$saved"
}

cached_deb() {  # newest cached .deb of package $1 (prints nothing if none)
    local debs
    debs=$(compgen -G "$DEBS/${1}_*.deb") || return 0
    sort -V <<< "$debs" | tail -n 1
}

download() {  # apt-get download whichever of "$@" is not cached yet
    local p need=()
    for p in "$@"; do [ -n "$(cached_deb "$p")" ] || need+=("$p"); done
    [ ${#need[@]} -gt 0 ] || return 0
    log "apt-get download ${#need[@]} package(s): ${need[*]}"
    (cd "$DEBS" && timeout 900 apt-get "${APT_OPTS[@]}" download "${need[@]}") > "$CACHE/apt.log" 2>&1 && return 0
    cat "$CACHE/apt.log" >&2
    return 1
}

# Fresh hosts (e.g. a new container) have no package lists at all.
resolve_packages || { apt_update; resolve_packages; } || die "cannot resolve linux-image-amd64"
if ! download "$KPKG" "${GUEST_LIST[@]}" "${QEMU_LIST[@]}"; then
    # Stale lists point at versions the mirror no longer has: refresh, retry once.
    log "download failed; refreshing package lists and retrying"
    apt_update
    resolve_packages || die "cannot resolve linux-image-amd64"
    download "$KPKG" "${GUEST_LIST[@]}" "${QEMU_LIST[@]}" || die "apt-get download failed (see above)"
fi

# --------------------------------------------------------------- 2. extract
extract() {  # extract DIR PKG...: unpack the cached .debs, unless DIR already has exactly these
    local dir=$1 want p d
    shift
    want=$(for p in "$@"; do basename "$(cached_deb "$p")"; done)
    if [ -f "$dir/.debs" ] && [ "$(cat "$dir/.debs")" = "$want" ]; then return 0; fi
    log "extracting $(basename "$dir") ($# packages)"
    rm -rf "$dir"
    mkdir -p "$dir"
    for p in "$@"; do
        d=$(cached_deb "$p")
        [ -n "$d" ] || die "package $p was not downloaded"
        dpkg-deb -x "$d" "$dir"
    done
    echo "$want" > "$dir/.debs"
}
SYSROOT=$CACHE/sysroot   # guest userspace
QROOT=$CACHE/qemu        # qemu, run from here with LD_LIBRARY_PATH
extract "$SYSROOT" "${GUEST_LIST[@]}"
extract "$QROOT" "${QEMU_LIST[@]}"
BUSYBOX=$SYSROOT/bin/busybox   # static: runs on the host too (depmod, cpio)
SYSLIBS=$SYSROOT/usr/lib/$ARCH:$SYSROOT/lib/$ARCH
QLIBS=$QROOT/usr/lib/$ARCH:$QROOT/lib/$ARCH
QEMU_BIN=$QROOT/usr/bin/qemu-system-x86_64
if LD_LIBRARY_PATH=$QLIBS ldd "$QEMU_BIN" | grep 'not found'; then
    die "qemu-system-x86_64 has unresolved libraries (above)"
fi

# Kernel: keep only vmlinuz and the modules we load (plus dependencies);
# the full package unpacks to ~400 MB.
KDEB=$(cached_deb "$KPKG")
KDIR=$CACHE/kernel/$(basename "$KDEB" .deb)
if [ ! -f "$KDIR/.ready" ] || [ "$(cat "$KDIR/.ready")" != "${MODULES[*]}" ]; then
    log "preparing kernel $(basename "$KDEB")"
    rm -rf "$KDIR" "$KDIR.full"
    mkdir -p "$KDIR"
    dpkg-deb -x "$KDEB" "$KDIR.full"
    KV=$(ls "$KDIR.full/lib/modules")
    # Debian's kernel package ships no modules.dep (its postinst runs depmod).
    "$BUSYBOX" depmod -b "$KDIR.full" "$KV"
    # modules.dep lists each module's full (transitive) dependency set.
    re=$(IFS='|'; echo "${MODULES[*]}")
    mapfile -t KOS < <(awk -F': *' -v re="(^|/)($re)\\\\.ko(\\\\.[a-z]+)?\$" \
        '$1 ~ re { print $1; n = split($2, d, " "); for (i = 1; i <= n; i++) print d[i] }' \
        "$KDIR.full/lib/modules/$KV/modules.dep" | sort -u)
    [ ${#KOS[@]} -ge ${#MODULES[@]} ] || die "kernel modules not found: ${MODULES[*]} (got: ${KOS[*]})"
    for ko in "${KOS[@]}"; do
        install -D -m 644 "$KDIR.full/lib/modules/$KV/$ko" "$KDIR/lib/modules/$KV/$ko"
    done
    cp "$KDIR.full/lib/modules/$KV"/modules.{order,builtin,builtin.modinfo} "$KDIR/lib/modules/$KV/"
    "$BUSYBOX" depmod -b "$KDIR" "$KV"
    install -D -m 644 "$KDIR.full/boot/vmlinuz-$KV" "$KDIR/vmlinuz"
    rm -rf "$KDIR.full"
    echo "${MODULES[*]}" > "$KDIR/.ready"
fi

# ------------------------------------------------------------- 3. initramfs
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry-rxe.XXXXXX")
trap 'rm -rf "$WORK"; [ -z "${PID_A:-}" ] || kill "$PID_A" 2>/dev/null || true' EXIT
R=$WORK/root
mkdir -p "$R"/{usr/bin,usr/sbin,usr/lib/$ARCH,usr/lib64,etc,proc,sys,dev,tmp,run,root,opt/ferry/bin,ferry}
# merged-/usr layout, as on Debian 12
for d in bin sbin lib lib64; do ln -s "usr/$d" "$R/$d"; done

install -m 755 "$BUSYBOX" "$R/usr/bin/busybox"
for a in $("$BUSYBOX" --list); do
    [ -e "$R/usr/bin/$a" ] || ln -s busybox "$R/usr/bin/$a"
done

# copy_with_libs FILE GUEST_DIR: install FILE there, plus every shared
# library ldd resolves for it into the guest's /usr/lib/$ARCH. The extracted
# packages come first on the search path so libibverbs matches the rxe
# provider; the rest (glibc, ...) comes from the host.
copy_with_libs() {
    local src=$1 dst out lib
    dst=$R$2/$(basename "$1")
    rm -f "$dst"
    install -D -m 755 "$src" "$dst"
    if ! out=$(LD_LIBRARY_PATH=$SYSLIBS ldd "$src" 2>&1); then
        case $out in
            *"not a dynamic executable"*) return 0 ;;   # static binary or script
            *) die "ldd $src failed: $out" ;;
        esac
    fi
    if grep -q 'not found' <<< "$out"; then
        die "$src needs libraries found neither on the host nor in the downloaded packages:
$out"
    fi
    while read -r lib; do
        [ -e "$R/usr/lib/$ARCH/$(basename "$lib")" ] || cp -L "$lib" "$R/usr/lib/$ARCH/"
    done < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<< "$out")
}

for t in "${GUEST_TOOLS[@]}"; do
    copy_with_libs "$SYSROOT/$t" /usr/bin
done
# libibverbs dlopen()s its providers, so ldd cannot see them: copy rxe's
# provider and the .driver file that tells libibverbs to load it.
for p in "$SYSROOT/usr/lib/$ARCH/libibverbs"/librxe-rdmav*.so; do
    copy_with_libs "$p" "/usr/lib/$ARCH/libibverbs"
done
install -D -m 644 "$SYSROOT/etc/libibverbs.d/rxe.driver" "$R/etc/libibverbs.d/rxe.driver"
# glibc dlopen()s libgcc_s for thread exit/cancellation (also invisible to ldd).
cp -L "/lib/$ARCH/libgcc_s.so.1" "$R/usr/lib/$ARCH/"
# The ELF interpreter path baked into every binary.
ln -sf "../lib/$ARCH/ld-linux-x86-64.so.2" "$R/usr/lib64/ld-linux-x86-64.so.2"

# The caller's binaries.
declare -A seen=()
for b in "${BINS[@]}"; do
    n=$(basename "$b")
    [ -z "${seen[$n]:-}" ] || die "two --bin files are named $n"
    seen[$n]=1
    copy_with_libs "$b" /opt/ferry/bin
done

cp -a "$KDIR/lib/modules" "$R/usr/lib/"
install -m 755 "$HERE/guest/init" "$R/init"
for g in rxe-pair on-peer peer-agent; do
    install -m 755 "$HERE/guest/$g" "$R/usr/bin/$g"
done
echo "root:x:0:0:root:/root:/bin/sh" > "$R/etc/passwd"
echo "root:x:0:" > "$R/etc/group"
printf 'FERRY_RXE_PERF=%s\nFERRY_RXE_RAILS=%s\n' "$PERF" "$RAILS" > "$R/ferry/config"
printf '%s\n' "$GUEST_CMD" > "$R/ferry/cmd.sh"

INITRD=$WORK/initramfs.cpio.gz
(cd "$R" && find . | "$BUSYBOX" cpio -o -H newc 2> "$WORK/cpio.err") | gzip -1 > "$INITRD" ||
    { cat "$WORK/cpio.err" >&2; die "building the initramfs failed"; }
# Release the cache lock: the VM still uses $QROOT and $KDIR, but another run
# only replaces those when the host's package set changed in between.
exec 9>&-
T_BUILT=$(date +%s)
log "initramfs $(du -h "$INITRD" | cut -f1) (${#BINS[@]} --bin file(s)), prepared in $((T_BUILT - T_START)) s"

# ------------------------------------------------------------------ 4. boot
# -nodefaults/-nic none: no NIC, no display, nothing leaves the VM.
# -no-reboot + panic=-1: a guest panic ends qemu instead of rebooting.
# --foreground: a Ctrl-C reaches qemu too (timeout otherwise puts it in its
# own process group, where it would outlive this script).
# clocksource=tsc tsc=reliable: TCG's CPU has no invariant-TSC flag, so the
# guest kernel would fall back to the emulated HPET, and every clock read
# (Instant::now, tokio's timers) would become a slow emulated MMIO access,
# unlike on real machines; perftest reads the TSC directly either way. QEMU's
# TSC is the same on every vCPU. Measured: ferry's 8-byte latency p50
# 70 -> 58 us, perftest's unchanged.
# sed -u: strip the serial console's CRs and SeaBIOS's terminal escapes
# (screen clears) without buffering the live output.
QEMU_BASE=("$QEMU_BIN" -L "$QROOT/usr/share/qemu" -L "$QROOT/usr/share/seabios"
           -accel tcg -cpu max -smp "$SMP" -m "$MEM"
           -nographic -nodefaults -no-reboot -serial stdio
           -kernel "$KDIR/vmlinuz" -initrd "$INITRD")
KARGS="console=ttyS0 panic=-1 loglevel=4 quiet clocksource=tsc tsc=reliable"
console_filter() { sed -u 's/\r$//; s/\x1bc//g; s/\x1b\[[0-9;?]*[A-Za-z]//g'; }
mkdir -p "$(dirname "$LOG")"
log "booting $VMS VM(s): tcg, ${SMP} vCPU, ${MEM} MiB each, timeout ${TIMEOUT}s; perf=$PERF; command: $GUEST_CMD"
QRC=0
if [ "$VMS" = 1 ]; then
    {   LD_LIBRARY_PATH=$QLIBS timeout --foreground -k 10 "$TIMEOUT" \
            "${QEMU_BASE[@]}" -nic none -append "$KARGS" \
            < /dev/null 2>&1 | console_filter | tee "$LOG"
        QRC=${PIPESTATUS[0]}
    } || true   # qemu's status is only a hint; the verdict comes from the console
else
    # Each wire is a pair of UDP sockets on the host's loopback, one per VM,
    # each frame one datagram. Not QEMU's TCP socket netdev: with it, any
    # round trip that needed user space in both VMs (a TCP request and its
    # answer, perftest's ib_send_lat) took ~48 ms instead of ~1 ms, most
    # likely Nagle and delayed ACKs on the host TCP stream under the frames.
    free_ports() {  # the first of six consecutive free UDP ports
        local p i busy
        while :; do
            p=$((20000 + RANDOM % 20000)) busy=0
            # /proc/net/udp lists local ports in hex; skip any in use.
            for i in 0 1 2 3 4 5; do
                grep -qi ":$(printf '%04X' $((p + i))) " /proc/net/udp /proc/net/udp6 2>/dev/null && busy=1
            done
            [ $busy = 1 ] || break
        done
        echo "$p"
    }
    WIRE_PORT=$(free_ports)   # VM a's end, then VM b's
    MGMT_PORT=$((WIRE_PORT + 2))
    WIRE1_PORT=$((WIRE_PORT + 4))
    nics() {  # nics a|b: both wires, MACs that name the role
        local n=1 mine=0 theirs=1
        [ "$1" = a ] || { n=2; mine=1; theirs=0; }
        echo "-netdev socket,id=wire,udp=127.0.0.1:$((WIRE_PORT + theirs)),localaddr=127.0.0.1:$((WIRE_PORT + mine))" \
             "-device virtio-net-pci,netdev=wire,mac=52:54:00:88:00:0$n,romfile=" \
             "-netdev socket,id=mgmt,udp=127.0.0.1:$((MGMT_PORT + theirs)),localaddr=127.0.0.1:$((MGMT_PORT + mine))" \
             "-device virtio-net-pci,netdev=mgmt,mac=52:54:00:99:00:0$n,romfile="
        [ "$RAILS" = 1 ] ||
            echo "-netdev socket,id=wire1,udp=127.0.0.1:$((WIRE1_PORT + theirs)),localaddr=127.0.0.1:$((WIRE1_PORT + mine))" \
                 "-device virtio-net-pci,netdev=wire1,mac=52:54:00:89:00:0$n,romfile="
    }
    LOG_A=${LOG%.log}-a.log
    # shellcheck disable=SC2046  # nics prints a word list on purpose
    LD_LIBRARY_PATH=$QLIBS timeout -k 10 "$TIMEOUT" "${QEMU_BASE[@]}" $(nics a) \
        -append "$KARGS ferry_role=a" < /dev/null > >(console_filter > "$LOG_A") 2>&1 &
    PID_A=$!
    {   # shellcheck disable=SC2046
        LD_LIBRARY_PATH=$QLIBS timeout --foreground -k 10 "$TIMEOUT" \
            "${QEMU_BASE[@]}" $(nics b) -append "$KARGS ferry_role=b" \
            < /dev/null 2>&1 | console_filter | tee "$LOG"
        QRC=${PIPESTATUS[0]}
    } || true
    kill "$PID_A" 2>/dev/null || true
    wait "$PID_A" 2>/dev/null || true
    log "VM a's console: $LOG_A"
fi
T_END=$(date +%s)
TIMES="wall $((T_END - T_START)) s (prepare $((T_BUILT - T_START)) s, VM $((T_END - T_BUILT)) s)"

# ---------------------------------------------------------------- 5. verdict
RC=$(grep -ao 'FERRY-RXE-EXIT=[0-9]*' "$LOG" | tail -n 1 | cut -d= -f2) || true
if [ -z "$RC" ]; then
    if [ "$QRC" = 124 ] || [ "$QRC" = 137 ]; then
        log "error: the VM did not finish within FERRY_RXE_TIMEOUT=${TIMEOUT}s; $TIMES; console log: $LOG"
        exit 124
    fi
    if grep -q 'Kernel panic' "$LOG"; then log "the guest kernel panicked"; fi
    die "no FERRY-RXE-EXIT marker on the console (qemu exit $QRC); $TIMES; console log: $LOG"
fi
if ! grep -q '^FERRY-RXE: READY' "$LOG"; then
    die "guest setup failed before rxe0 was ready (guest rc $RC); $TIMES; console log: $LOG"
fi
if [ "$RC" != 0 ] && [ "$VMS" = 2 ]; then
    log "VM a's console, last lines:"
    tail -n 40 "$LOG_A" >&2 || true
fi
log "guest command exit status $RC; $TIMES"
exit "$RC"
