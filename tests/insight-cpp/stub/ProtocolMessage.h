// Stand-in for Insight's ProtocolMessage.h: see insight_stubs.h.
#pragma once
#include "insight_stubs.h"
