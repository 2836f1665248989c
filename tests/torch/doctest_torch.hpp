// doctest in a test that includes LibTorch: LibTorch pulls in glog, whose CHECK macros would
// shadow doctest's (and count nothing). Include LibTorch first, then this header.
#pragma once

#undef CHECK
#undef CHECK_EQ
#undef CHECK_NE
#undef CHECK_LT
#undef CHECK_LE
#undef CHECK_GT
#undef CHECK_GE
#include <doctest/doctest.h>
