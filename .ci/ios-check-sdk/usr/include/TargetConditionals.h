/*
 * Stand-in for the iOS SDK's TargetConditionals.h, for .ci/mobile-check only:
 * ring's C includes it on Apple targets, and the SDK (Xcode) is not available
 * here. The check compiles ring's C freestanding (RING_CORE_NOSTDLIBINC), so
 * this is the only SDK header it needs. Nothing built with it is linked.
 */
#pragma once
#define TARGET_OS_MAC 1
#define TARGET_OS_OSX 0
#define TARGET_OS_IPHONE 1
#define TARGET_OS_IOS 1
#define TARGET_OS_SIMULATOR 0
#define TARGET_OS_WATCH 0
#define TARGET_OS_TV 0
#define TARGET_OS_VISION 0
#define TARGET_OS_EMBEDDED 1
