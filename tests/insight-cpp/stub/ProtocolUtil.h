// Stand-in for Insight's ProtocolUtil.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
