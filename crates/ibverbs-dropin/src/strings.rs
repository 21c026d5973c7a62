// SPDX-License-Identifier: GPL-2.0-or-later
//! The string and rate helpers of libibverbs (pure functions).

use std::ffi::{c_char, c_int};

use crate::sys::*;

macro_rules! cstr {
    ($s:literal) => {
        concat!($s, "\0").as_ptr() as *const c_char
    };
}

#[no_mangle]
pub extern "C" fn ibv_node_type_str(t: ibv_node_type) -> *const c_char {
    match t {
        IBV_NODE_CA => cstr!("InfiniBand channel adapter"),
        IBV_NODE_SWITCH => cstr!("InfiniBand switch"),
        IBV_NODE_ROUTER => cstr!("InfiniBand router"),
        IBV_NODE_RNIC => cstr!("iWARP NIC"),
        IBV_NODE_USNIC => cstr!("usNIC"),
        IBV_NODE_USNIC_UDP => cstr!("usNIC UDP"),
        IBV_NODE_UNSPECIFIED => cstr!("unspecified"),
        _ => cstr!("unknown"),
    }
}

#[no_mangle]
pub extern "C" fn ibv_port_state_str(s: ibv_port_state) -> *const c_char {
    match s {
        IBV_PORT_NOP => cstr!("PORT_NOP"),
        IBV_PORT_DOWN => cstr!("PORT_DOWN"),
        IBV_PORT_INIT => cstr!("PORT_INIT"),
        IBV_PORT_ARMED => cstr!("PORT_ARMED"),
        IBV_PORT_ACTIVE => cstr!("PORT_ACTIVE"),
        IBV_PORT_ACTIVE_DEFER => cstr!("PORT_ACTIVE_DEFER"),
        _ => cstr!("invalid state"),
    }
}

#[no_mangle]
pub extern "C" fn ibv_event_type_str(e: ibv_event_type) -> *const c_char {
    const NAMES: [&str; 22] = [
        "CQ error\0",
        "local work queue catastrophic error\0",
        "invalid request local work queue error\0",
        "local access violation work queue error\0",
        "communication established\0",
        "send queue drained\0",
        "path migrated\0",
        "path migration request error\0",
        "local catastrophic error\0",
        "port active\0",
        "port error\0",
        "LID change\0",
        "P_Key change\0",
        "SM change\0",
        "SRQ catastrophic error\0",
        "SRQ limit reached\0",
        "last WQE reached\0",
        "client reregistration\0",
        "GID table change\0",
        "WQ fatal\0",
        "unknown\0",
        "unknown\0",
    ];
    NAMES.get(e as usize).unwrap_or(&"unknown\0").as_ptr() as *const c_char
}

#[no_mangle]
pub extern "C" fn ibv_wc_status_str(s: ibv_wc_status) -> *const c_char {
    const NAMES: [&str; 23] = [
        "success\0",
        "local length error\0",
        "local QP operation error\0",
        "local EE context operation error\0",
        "local protection error\0",
        "Work Request Flushed Error\0",
        "memory management operation error\0",
        "bad response error\0",
        "local access error\0",
        "remote invalid request error\0",
        "remote access error\0",
        "remote operation error\0",
        "transport retry counter exceeded\0",
        "RNR retry counter exceeded\0",
        "local RDD violation error\0",
        "remote invalid RD request\0",
        "aborted error\0",
        "invalid EE context number\0",
        "invalid EE context state\0",
        "fatal error\0",
        "response timeout error\0",
        "general error\0",
        "TM error\0",
    ];
    NAMES.get(s as usize).unwrap_or(&"unknown\0").as_ptr() as *const c_char
}

const RATES: [(ibv_rate, c_int, c_int); 21] = [
    (IBV_RATE_2_5_GBPS, 1, 2500),
    (IBV_RATE_5_GBPS, 2, 5000),
    (IBV_RATE_10_GBPS, 4, 10000),
    (IBV_RATE_20_GBPS, 8, 20000),
    (IBV_RATE_30_GBPS, 12, 30000),
    (IBV_RATE_40_GBPS, 16, 40000),
    (IBV_RATE_60_GBPS, 24, 60000),
    (IBV_RATE_80_GBPS, 32, 80000),
    (IBV_RATE_120_GBPS, 48, 120000),
    (IBV_RATE_14_GBPS, 0, 14062),
    (IBV_RATE_56_GBPS, 0, 56250),
    (IBV_RATE_112_GBPS, 0, 112500),
    (IBV_RATE_168_GBPS, 0, 168750),
    (IBV_RATE_25_GBPS, 10, 25781),
    (IBV_RATE_100_GBPS, 40, 103125),
    (IBV_RATE_200_GBPS, 80, 206250),
    (IBV_RATE_300_GBPS, 120, 309375),
    (IBV_RATE_28_GBPS, 11, 28125),
    (IBV_RATE_50_GBPS, 20, 53125),
    (IBV_RATE_400_GBPS, 160, 425000),
    (IBV_RATE_600_GBPS, 240, 637500),
];

#[no_mangle]
pub extern "C" fn ibv_rate_to_mult(r: ibv_rate) -> c_int {
    RATES.iter().find(|x| x.0 == r && x.1 != 0).map(|x| x.1).unwrap_or(-1)
}

#[no_mangle]
pub extern "C" fn mult_to_ibv_rate(m: c_int) -> ibv_rate {
    RATES.iter().find(|x| x.1 == m && m != 0).map(|x| x.0).unwrap_or(IBV_RATE_MAX)
}

#[no_mangle]
pub extern "C" fn ibv_rate_to_mbps(r: ibv_rate) -> c_int {
    RATES.iter().find(|x| x.0 == r).map(|x| x.2).unwrap_or(-1)
}

#[no_mangle]
pub extern "C" fn mbps_to_ibv_rate(m: c_int) -> ibv_rate {
    RATES.iter().find(|x| x.2 == m).map(|x| x.0).unwrap_or(IBV_RATE_MAX)
}
